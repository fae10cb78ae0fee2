# Shared by scripts/*.sh (sourced): free loopback ports and the bench tools' paths, in bash
# alone (no python3 or other tool `make deps` does not install).

# The servers a script starts are stopped with SIGTERM between its rounds, with nothing routing
# to them: no drain delay (scripts/day-two.sh, which measures the drain, sets its own).
export RATELIMITD_DRAIN_DELAY=${RATELIMITD_DRAIN_DELAY:-0s}

# A loopback port nothing listens on and that no earlier call in this script returned (they are
# remembered in a file, as `$(free_port)` runs in a subshell). A port is tried by connecting to
# it: refused means free. Racy as every "free port" is: bind promptly.
_ports_given=$(mktemp)
free_port() {
  _free_port 12000 0
}

# A free port for a Redis Cluster node: its bus port (port + 10000) free and not given too, both
# below the ephemeral range.
free_cluster_port() {
  _free_port 2700 10000
}

_free_port() { # SPAN BUS_OFFSET (0: none)
  local port
  while :; do
    # Below the kernel's ephemeral range (32768 up), which client sockets take ports from.
    port=$((20000 + RANDOM % $1))
    _port_free "$port" || continue
    if [ "$2" != 0 ]; then
      _port_free $((port + $2)) || continue
      echo $((port + $2)) >>"$_ports_given"
    fi
    echo "$port" >>"$_ports_given"
    echo "$port"
    return
  done
}

_port_free() { # PORT: not given before and nothing listens on it
  ! grep -qx "$1" "$_ports_given" && ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# Waits until something accepts on loopback port $1, trying every 0.1 s up to $2 times (200:
# 20 s); says so on stderr and returns 1 when nothing does.
wait_port() { # PORT [TRIES]
  local i
  for i in $(seq "${2:-200}"); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on 127.0.0.1:$1" >&2
  return 1
}

# CPU time of process $1 so far, in clock ticks (user + system, /proc/PID/stat); with a second
# argument `user`, the user time too, as a second field.
cpu_ticks() { # PID [user]
  if [ "${2:-}" = user ]; then awk '{print $14 + $15, $14}' "/proc/$1/stat"; else awk '{print $14 + $15}' "/proc/$1/stat"; fi
}

# Resident memory of process $1 now, in KiB (VmRSS of /proc/PID/status).
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

# Context switches of process $1 so far, voluntary and not, summed over its threads.
ctx_switches() { cat /proc/"$1"/task/*/status | awk '/ctxt_switches/ {s += $2} END {print s}'; }

# Every script's EXIT trap (`pids=()` first, then `trap cleanup_all EXIT`): kills the processes
# in the caller's `pids` and waits for them (so that tools writing at exit, callgrind, have
# written), copies $WORK's files to $KEEP when KEEP is set, and removes $WORK (when set) and the
# ports file.
cleanup_all() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -n "${KEEP:-}" ] && [ -n "${WORK:-}" ]; then
    mkdir -p "$KEEP" && cp -r "$WORK"/. "$KEEP"/ 2>/dev/null || true
  fi
  rm -rf ${WORK:+"$WORK"} "$_ports_given"
}

# A throwaway redis-server on loopback port $1 (nothing kept on disk), replacing the calling
# (sub)shell: run it as `redis_server PORT &` and `$!` is redis-server's pid. Further arguments
# go to redis-server; REDIS_WRAP (e.g. `valgrind --tool=callgrind ...`) runs it under a tool.
redis_server() { # PORT [redis-server arguments]
  local port=$1
  shift
  exec ${REDIS_WRAP:-} redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no "$@" >/dev/null 2>&1
}

# Starts a redis-server on a free loopback port for the script's run: sets REDIS_PORT (unless
# the caller set it) and REDIS_PID, adds the pid to the caller's `pids` (which cleanup_all
# kills), and waits until it accepts.
start_redis() {
  REDIS_PORT=${REDIS_PORT:-$(free_port)}
  redis_server "$REDIS_PORT" &
  REDIS_PID=$!
  pids+=("$REDIS_PID")
  wait_port "$REDIS_PORT" 100
}

# h2load sending the bench request (a file `baseline --write-request` wrote) to the rate limit
# service on 127.0.0.1:PORT; further arguments go to h2load.
h2_bench() { # PORT REQUEST_FILE [h2load arguments]
  local port=$1 request=$2
  shift 2
  h2load -t1 "$@" -d "$request" -H 'content-type: application/grpc' -H 'te: trailers' \
    "http://127.0.0.1:$port/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
}

# The median of the numbers on stdin (separated by spaces or lines).
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

# Builds bench target $1 (release profile) and prints its executable's path as cargo reports
# it (not guessed from file times).
bench_bin() {
  cargo bench --bench "$1" --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | grep "/$1-" | tail -1
}

# Sets SERVER_CMD to the command line of bench server NAME (bare, naive, memory, redis, or the
# path of a ratelimitd binary, run on the memory backend) serving gRPC on 127.0.0.1:PORT: the
# baselines are $BASELINE (benches/baseline.rs), the rest this checkout's release build with
# the bench domain. REDIS_URL is for naive and redis; REDIS_TIMEOUT is the Redis backend's
# call budget (longer under valgrind). Returns 2 for an unknown name.
bench_server_cmd() { # NAME PORT [REDIS_URL] [REDIS_TIMEOUT]; NAME: bare, naive, memory, redis,
  # a ratelimitd binary's path (memory backend), or redis:PATH (that binary on Redis)
  local name=$1 port=$2 redis=${3:-} timeout=${4:-1s}
  local service=(--config benches/limits.yaml --grpc-addr "127.0.0.1:$port"
    --http-addr "127.0.0.1:$(free_port)" --log-level warn)
  case $name in
    bare) SERVER_CMD=("$BASELINE" --mode noop --addr "127.0.0.1:$port") ;;
    naive) SERVER_CMD=("$BASELINE" --mode evalsha --addr "127.0.0.1:$port" --redis "$redis") ;;
    memory) SERVER_CMD=(./target/release/ratelimitd "${service[@]}" --backend memory) ;;
    redis) SERVER_CMD=(./target/release/ratelimitd "${service[@]}" --backend redis
      --redis-url "$redis" --redis-timeout "$timeout") ;;
    redis:*) [ -x "${name#redis:}" ] || return 2
      SERVER_CMD=("${name#redis:}" "${service[@]}" --backend redis
      --redis-url "$redis" --redis-timeout "$timeout") ;;
    *) [ -x "$name" ] || return 2
      SERVER_CMD=("$name" "${service[@]}" --backend memory) ;;
  esac
}

# Writes N pipelined calls of the Redis script, in RESP, each deciding K identical requests of
# the bench domain (sliding window + fixed window, the bench request's keys): `HOW NAME` is
# `FCALL <function>` or `EVALSHA <sha1>`. The layout is script.lua's (numbers packed as
# little-endian doubles: perl, part of every Debian, packs them). For `redis-cli --pipe`.
script_calls() { # K N HOW NAME
  perl -e '
    my ($k, $n, $how, $name) = @ARGV;
    my $numbers = pack("d<*", 1, 2, 1,                   # entries, counters, debt bound
      1, 2, 1e6, 1e6, 1e6,                               # client: sliding window, 1e6 per s
      2, 1, 1e8, 1e6, 1e8,                               # route: fixed window, 1e8 per s
      $k, 2, 1, 1, 1, 2, 1, 1);                          # a run of k: 1 hit each, enforced
    my @args = ($how, $name, 2, "ratelimit:{bench}:client:c1:s1000000:0",
      "ratelimit:{bench}:route:/api/1:f1000000:0", "decide", $numbers);
    my $one = "*" . scalar(@args) . "\r\n" . join("", map { "\$" . length($_) . "\r\n$_\r\n" } @args);
    print $one x $n;' "$@"
}
