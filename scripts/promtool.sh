#!/usr/bin/env bash
# Installs promtool (Debian's prometheus package) so that the chart's alert rules are checked by
# `promtool check rules` and `promtool test rules` in tests/chart.rs. The package's server is
# kept from starting (a policy-rc.d for the length of the install). Does nothing when promtool
# is already there. Used by .ci/run; locally those checks are skipped, saying so, without it.
set -euo pipefail

command -v promtool >/dev/null 2>&1 && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
policy=/usr/sbin/policy-rc.d
added=""
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  added=1
fi
trap '[ -n "$added" ] && $sudo rm -f "$policy"' EXIT
echo "promtool: installing Debian's prometheus package"
$sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends prometheus >/dev/null
promtool --version | head -1
