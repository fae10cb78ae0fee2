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
