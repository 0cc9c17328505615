#!/usr/bin/env bash
# Side-by-side benchmark of mqkv against etcd (durable SET/GET) and
# mosquitto (MQTT QoS 1 pub/sub), in alternating rounds on this machine.
# Installs the peers from Debian packages if missing. Flags go to the
# program, e.g.:  bench/peers/run.sh -rounds 3 -duration 10s -clients 64
set -euo pipefail
if ! command -v etcd >/dev/null || ! command -v mosquitto >/dev/null && ! [ -x /usr/sbin/mosquitto ]; then
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server mosquitto >/dev/null
fi
export PATH="$PATH:/usr/sbin"
cd "$(dirname "$0")"
exec go run . "$@"
