"""specops: remote-ops automation for training EAGLE-3 drafts on remote GPU hosts.

What each module owns: README.md, "How the code is laid out".
"""
