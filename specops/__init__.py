"""specops: remote-ops automation for training EAGLE-3 drafts on remote GPU hosts.

Modules, one concept each:
  inventory    the Ansible-shaped inventory and host selection
  host         the one module that talks to a host (SSH or local): commands, files, rsync/ssh argv
  fanout       one step on many hosts in parallel, one result row each
  facts        `inv hosts`
  deploy       code sync (rsync, SFTP fallback);   deps      each host's venv vs requirements/
  servicefiles the vLLM command line, unit, env file and tmux script, rendered
  supervisors  systemd or tmux keeping vLLM up;    service   `inv serve`;  progress  startup phases
  secrets      VLLM_API_KEY / HF_TOKEN from this machine only;  tunnel  `inv tunnel`
  runs         detached runs;  watch  `inv status` / `inv logs`;  artifacts  `inv pull`;  transfer  copies home
  jobs         `inv generate` / `inv train` / `inv eval` as runs;  demo  `inv demo`
"""
