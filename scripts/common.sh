# Shared by scripts/*.sh (sourced): free loopback ports and the bench tools' paths, in bash
# alone (no python3 or other tool `make deps` does not install).

# A loopback port nothing listens on and that no earlier call in this script returned (they are
# remembered in a file, as `$(free_port)` runs in a subshell). A port is tried by connecting to
# it: refused means free. Racy as every "free port" is: bind promptly.
_ports_given=$(mktemp)
free_port() {
  local port
  while :; do
    # Below the kernel's ephemeral range (32768 up), which client sockets take ports from.
    port=$((20000 + RANDOM % 12000))
    grep -qx "$port" "$_ports_given" && continue
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port" >>"$_ports_given"
      echo "$port"
      return
    fi
  done
}

# Builds bench target $1 (release profile) and prints its executable's path as cargo reports
# it (not guessed from file times).
bench_bin() {
  cargo bench --bench "$1" --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | grep "/$1-" | tail -1
}

# Writes N pipelined calls of the Redis script, in RESP, each deciding K identical requests of
# the bench domain (sliding window + fixed window, the bench request's keys): `HOW NAME` is
# `FCALL <function>` or `EVALSHA <sha1>`. The layout is script.lua's (numbers packed as
# little-endian doubles: perl, part of every Debian, packs them). For `redis-cli --pipe`.
script_calls() { # K N HOW NAME
  perl -e '
    my ($k, $n, $how, $name) = @ARGV;
    my $numbers = pack("d<*", 1, 2,                      # entries, counters
      1, 2, 1e6, 1e6, 1e6,                               # client: sliding window, 1e6 per s
      2, 1, 1e8, 1e6, 1e8,                               # route: fixed window, 1e8 per s
      $k, 2, 1, 1, 1, 2, 1, 1);                          # a run of k: 1 hit each, enforced
    my @args = ($how, $name, 2, "ratelimit:{bench}:client:c1:s1000000:0",
      "ratelimit:{bench}:route:/api/1:f1000000:0", "decide", $numbers);
    my $one = "*" . scalar(@args) . "\r\n" . join("", map { "\$" . length($_) . "\r\n$_\r\n" } @args);
    print $one x $n;' "$@"
}
