"""specops: remote-ops automation for training EAGLE-3 drafts on remote GPU hosts.

Modules, one concept each:
  inventory  - the Ansible-shaped inventory and host selection
  host       - the one module that talks to a host (SSH or local)
  fanout     - running one step on many hosts in parallel, one result row each
  facts      - `inv hosts`
  deploy     - code sync (rsync, SFTP fallback);  deps - the hosts' venvs
  service    - vLLM under systemd or tmux;         runs - detached runs
"""
