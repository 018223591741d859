#!/usr/bin/env bash
# with_env.sh ENV_FILE COMMAND [ARG...]: COMMAND with the host's env file exported, so that secrets
# (VLLM_API_KEY, HF_TOKEN) reach a run without ever being on a command line. An ENV_FILE that is
# empty or unreadable exports nothing. Used by run.sh (every run) and by specops's preflights.
env_file=$1
shift
if [ -n "$env_file" ] && [ -r "$env_file" ]; then
  set -a
  . "$env_file"
  set +a
fi
exec "$@"
