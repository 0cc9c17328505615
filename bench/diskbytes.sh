#!/usr/bin/env bash
# What a durable SET costs the disk: bytes handed to write(2) (replies to
# the clients included) and bytes of page cache made dirty (which
# writeback then writes to the disk) for each SET, for a node on its own,
# a one-node cluster and Redis with appendfsync always, each on a fresh
# server under the same load.
#
#   bench/diskbytes.sh [PIPELINE] [REQUESTS] [REV]
#
# The load: redis-benchmark -t set -c 50 -d 256 -r 10000 -n REQUESTS
# -P PIPELINE (1 and 100000 by default; KEYSPACE=one in the environment
# for redis-benchmark's single key). REV is a git revision to build (the
# working tree by default). Figures come from /proc/PID/io around the
# run: wchar (bytes written to files and sockets, zeros ahead of the log
# included) and write_bytes (bytes of the pages the writes dirtied: the
# kernel counts a whole folio each time a clean one is dirtied, so a
# one-byte write into a clean 512 KiB folio counts 512 KiB, as its
# writeback writes). Why: docs/benchmarks.md, "What the zeros ahead cost
# the disk".
#
# Needs redis-server and redis-tools (apt-get install redis-server
# redis-tools) and python3 (free ports).
set -euo pipefail
pipeline=${1:-1}
n=${2:-100000}
rev=${3:-.}
cd "$(dirname "$0")/.."
. bench/lib.sh
keyspace
scratch
buildrev "$rev" "$work/mqkv"

launch() {
	case $1 in
	redis) redis-server --port "$port" --bind 127.0.0.1 --dir "$work/data" --appendonly yes --appendfsync always --save '' --daemonize no --loglevel warning >/dev/null & ;;
	alone) "$work/mqkv" serve --data-dir "$work/data" --listen "127.0.0.1:$(freeport)" --resp-listen "127.0.0.1:$port" --log-level error >/dev/null 2>&1 & ;;
	cluster) "$work/mqkv" serve --data-dir "$work/data" --listen "127.0.0.1:$(freeport)" --resp-listen "127.0.0.1:$port" --node-id n1 --cluster-listen "127.0.0.1:$(freeport)" --log-level error >/dev/null 2>&1 & ;;
	esac
}

# io PID FIELD prints FIELD of /proc/PID/io.
io() { awk -v f="$2:" '$1 == f {print $2}' "/proc/$1/io"; }

printf '# -c 50 -d 256 -P %s -n %s %s\n' "$pipeline" "$n" "${keys[*]:-one key}"
printf '%-8s %14s %16s\n' server "written B/SET" "dirtied B/SET"
for s in alone cluster redis; do
	fresh "$work/data" launch "$s" || {
		echo "diskbytes.sh: $s did not start (three tries)" >&2
		exit 1
	}
	w0=$(io "$pid" wchar) d0=$(io "$pid" write_bytes)
	timeout 600 redis-benchmark -h 127.0.0.1 -p "$port" -t set -c 50 -d 256 "${keys[@]}" -n "$n" -P "$pipeline" -q >/dev/null
	w1=$(io "$pid" wchar) d1=$(io "$pid" write_bytes)
	kill "$pid" && wait "$pid" 2>/dev/null || true
	pid=
	printf '%-8s %14d %16d\n' "$s" $(((w1 - w0) / n)) $(((d1 - d0) / n))
done
