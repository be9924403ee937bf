# ci/softroce-guest.sh -- helpers for commands that run inside a Soft-RoCE
# guest; ci/softroce.sh and ci/softroce-2host.sh source it before the
# command.  Every wait is bounded and, when it gives up, says on stderr what
# it waited for and returns 1: a caller that cannot go on fails, it never
# skips.
#
# Guest environment: SOFTROCE_SHARE (read-write dir every guest of the run
# mounts), SOFTROCE_IP, SOFTROCE_NAME (empty with one guest); with two
# guests also SOFTROCE_PEER (the other guest's name), SOFTROCE_PEER_IP,
# SOFTROCE_IP_A and SOFTROCE_IP_B.
# shellcheck shell=bash

softroce_say() { echo "[guest ${SOFTROCE_NAME:-vm} $(date +%T)] $*" >&2; }

# softroce_gid_index [-v] [DEV]: prints the index of DEV's (rxe0) IPv4-mapped
# RoCE v2 GID on port 1; -v also lists every non-zero GID on stderr.  Shell
# builtins only: the table has 1024 entries and a fork each costs minutes
# under TCG.
softroce_gid_index() {
  local verbose='' dev g v i ty found=''
  [ "${1:-}" = -v ] && { verbose=1; shift; }
  dev=${1:-rxe0}
  local p=/sys/class/infiniband/$dev/ports/1
  for g in "$p"/gids/*; do
    read -r v < "$g" || continue
    [ "$v" = "0000:0000:0000:0000:0000:0000:0000:0000" ] && continue
    i=${g##*/}
    read -r ty < "$p/gid_attrs/types/$i" 2>/dev/null || ty='?'
    [ -n "$verbose" ] && echo "gid[$i] = $v ($ty)" >&2
    if [ -z "$found" ] && [[ $v == 0000:0000:0000:0000:0000:ffff:* ]] && [ "$ty" != "IB/RoCE v1" ]; then
      found=$i
      [ -n "$verbose" ] || break
    fi
  done
  [ -n "$found" ] || { softroce_say "no IPv4 RoCE v2 GID on $dev"; return 1; }
  echo "$found"
}

# softroce_mark NAME: tells the other guests that NAME happened.
softroce_mark() { : > "$SOFTROCE_SHARE/marks/$1"; }

# softroce_poll SECS WHAT CMD...: runs CMD every 0.1 s until it succeeds;
# after SECS seconds says it gave up waiting for WHAT and returns 1.  CMD
# returning 2 means "never": give up now.
softroce_poll() {
  local secs=$1 what=$2 end; shift 2
  end=$(( SECONDS + secs ))
  until "$@"; do
    [ $? -eq 2 ] && return 1
    [ $SECONDS -ge $end ] && { softroce_say "gave up after ${secs}s waiting for $what"; return 1; }
    sleep 0.1
  done
}

# softroce_await NAME SECS: waits until some guest has marked NAME.
softroce_await() { softroce_poll "$2" "mark '$1'" test -e "$SOFTROCE_SHARE/marks/$1"; }

# softroce_await_peer SECS: waits until the other guest's command finished.
softroce_await_peer() {
  softroce_poll "$1" "guest $SOFTROCE_PEER to finish" test -e "$SOFTROCE_SHARE/rc-$SOFTROCE_PEER"
}

# softroce_wait_listen PORT SECS [PID]: waits until a TCP socket listens on
# PORT in this guest (fails at once when PID, the server, has exited).
softroce_wait_listen() {
  softroce_poll "$2" "a listener on port $1" _softroce_listening "$1" "${3:-}"
}
_softroce_listening() { # PORT [PID]
  if [ -n "$2" ] && ! kill -0 "$2" 2>/dev/null; then
    softroce_say "the server (pid $2) exited before it listened on port $1"; return 2
  fi
  [ -n "$(ss -Hltn "sport = :$1")" ]
}

# softroce_wait_port HOST PORT SECS: waits until HOST:PORT accepts a TCP
# connection.  The probe connects and closes: only for servers that take
# that (kvlane agents do; one-shot servers such as perftest do not: mark
# them ready with softroce_serve instead).
softroce_wait_port() {
  softroce_poll "$3" "$1:$2 to accept connections" timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

# softroce_serve NAME PORT SECS CMD...: runs the one-shot server CMD (at
# most SECS seconds), marks NAME once it listens on PORT, waits for it and
# prints its output; returns its exit code.
softroce_serve() {
  local name=$1 port=$2 secs=$3 pid rc; shift 3
  timeout "$secs" "$@" > "/tmp/$name.srv" 2>&1 & pid=$!
  if ! softroce_wait_listen "$port" 30 "$pid"; then
    kill "$pid" 2>/dev/null; wait "$pid"; cat "/tmp/$name.srv"; return 1
  fi
  softroce_mark "$name"
  wait "$pid" && rc=0 || rc=$?
  echo "--- $name server ($*): rc=$rc"; cat "/tmp/$name.srv"
  return $rc
}

# softroce_client NAME SECS CMD...: waits (30 s at most) until the server
# NAME is marked ready, runs CMD (at most SECS seconds) and prints its
# output, which stays in /tmp/NAME.cli; returns its exit code.
softroce_client() {
  local name=$1 secs=$2 rc; shift 2
  softroce_await "$name" 30 || return 1
  timeout "$secs" "$@" > "/tmp/$name.cli" 2>&1 && rc=0 || rc=$?
  echo "--- $name client ($*): rc=$rc"; cat "/tmp/$name.cli"
  return $rc
}

# softroce_rxe_counters [DEV]: DEV's (rxe0) non-zero port counters on one
# line, e.g. "completer_retry_err=206 duplicate_request=0 ..." (retransmits,
# duplicates, sequence errors: what to look at when a transfer failed).
softroce_rxe_counters() {
  (cd "/sys/class/infiniband/${1:-rxe0}/ports/1/hw_counters" && grep -H . -- *) |
    awk -F: '$2 != 0 { printf "%s=%s ", $1, $2 } END { print "" }'
}
