#!/usr/bin/env bash
# The wrapper of one specops run, started inside its tmux session by specops/runs.py:
#
#   run.sh RUN_DIR PYTHON [ENV_FILE]
#
# Runs RUN_DIR/cmd with stdin from /dev/null and stdout+stderr appended to RUN_DIR/log, with the
# host's env file exported (so secrets never appear on a command line), then records
# RUN_DIR/exit_code however the command ended (a full disk included: RUN_DIR/disk_full then says so)
# and writes RUN_DIR/manifest.json.
#
# SIGINT/SIGTERM (`inv stop`) reach the whole process group; this shell traps them, so the command
# gets them with their default meaning while the wrapper lives on to record the exit code (130/143
# when the command dies of them). SIGHUP is not trapped: a killed tmux session or a rebooted host
# leaves no exit code, which `inv status` reports as "lost".
#
# The body is one function so bash has parsed all of it before running any: redeploying this file
# while a run is in progress cannot change what the running wrapper does.

main() {
  local dir=$1 python=$2 env_file=${3:-}
  local here
  here=$(cd "$(dirname "$0")" && pwd)
  cd "$dir" || exit 1
  umask 077  # the log, exit code and every output: the run's user's alone, whatever tmux's umask
  trap : INT TERM
  export PYTHONUNBUFFERED=1
  # Room for the end record, taken while there is room: a run that fills the disk still records how
  # it ended (the exit code, and that the disk was full) instead of being "lost" with an empty log.
  head -c 4096 /dev/zero >.end.reserve 2>/dev/null
  bash "$here/with_env.sh" "$env_file" bash ./cmd </dev/null >>log 2>&1
  local code=$?
  record_end "$code"
  "$python" "$here/manifest.py" "$dir" </dev/null >>log 2>&1
  exit "$code"
}

# exit_code, written into the reserved blocks when a new file cannot get any; with no free space left
# (or the plain write refused), disk_full says so, for `inv status`.
record_end() {
  local code=$1 full=no
  [ "$(stat -f -c %a . 2>/dev/null)" = 0 ] && full=yes
  if [ $full = yes ] || ! { printf '%s\n' "$code" >.exit_code.tmp && mv -f .exit_code.tmp exit_code; }; then
    rm -f .exit_code.tmp
    printf '%s\n' "$code" 1<>.end.reserve && truncate -s "$(( ${#code} + 1 ))" .end.reserve \
      && mv -f .end.reserve exit_code
    printf 'disk full\n' >disk_full 2>/dev/null || : >disk_full
  fi
  rm -f .end.reserve
}

main "$@"
