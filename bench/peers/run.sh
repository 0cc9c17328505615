#!/usr/bin/env bash
# Side-by-side benchmark of mqkv against etcd (durable SET/GET, etcd's
# gRPC connection count swept), mosquitto (MQTT QoS 1 pub/sub), a
# three-node NATS cluster (MQTT across nodes: -only
# across-qos0,across-qos1), three-node clusters of etcd and NATS
# JetStream KV (-only cluster-set,cluster-get), memcached (mqkv's
# memcached endpoint: -only mc-set,mc-get) and mqkv attached to mosquitto
# (-only attach-set,attach-get), the contestants taking turns on this
# machine. -baseline BIN runs another mqkv build beside; -profile DIR
# profiles every mqkv node at once and prints where the CPU went.
# Installs etcd, mosquitto and memcached from Debian packages if missing;
# nats-server is built from the Go module proxy. Flags go to the program,
# e.g.:  bench/peers/run.sh -rounds 3 -duration 10s -clients 64
set -euo pipefail
if ! command -v etcd >/dev/null || ! command -v memcached >/dev/null || { ! command -v mosquitto >/dev/null && ! [ -x /usr/sbin/mosquitto ]; }; then
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server mosquitto memcached >/dev/null
fi
export PATH="$PATH:/usr/sbin"
cd "$(dirname "$0")"
exec go run . "$@"
