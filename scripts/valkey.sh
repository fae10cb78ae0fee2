#!/usr/bin/env bash
# Installs valkey-server on Debian from the -backports suite of the machine's own Debian source
# (the same mirror and key as its main suite; nothing else is added). Does nothing when
# valkey-server is already there. Used by .ci/run; `make test` runs the Redis suites on Valkey
# too wherever valkey-server is installed.
set -euo pipefail

command -v valkey-server >/dev/null 2>&1 && exit 0
. /etc/os-release
codename=${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}
sources=/etc/apt/sources.list.d/debian.sources
if [ -r "$sources" ]; then
  # deb822: the first stanza's mirror and key.
  uri=$(awk '/^URIs:/ {print $2; exit}' "$sources")
  key=$(awk '/^Signed-By:/ {print $2; exit}' "$sources")
else
  uri=$(awk '$1 == "deb" && $0 !~ /security/ {print ($2 ~ /^\[/ ? $3 : $2); exit}' /etc/apt/sources.list)
  key=/usr/share/keyrings/debian-archive-keyring.gpg
fi
[ -n "$uri" ] || { echo "valkey: no Debian source found" >&2; exit 1; }
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
printf 'Types: deb\nURIs: %s\nSuites: %s-backports\nComponents: main\nSigned-By: %s\n' \
  "$uri" "$codename" "${key:-/usr/share/keyrings/debian-archive-keyring.gpg}" |
  $sudo tee /etc/apt/sources.list.d/ratelimitd-backports.sources >/dev/null
echo "valkey: installing valkey-server from ${codename}-backports"
$sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq valkey-server >/dev/null
valkey-server --version
