package journal

import "io"

// Zeros written ahead of a log's records (this journal's segments, and a
// group's raft-wal segments: replica's walFS) make each later
// fdatasync cheaper: the blocks are already written, so the sync has no
// extent or size to commit. But how they are written decides how much the
// later syncs write. The kernel caches a file in folios sized by the write
// that made them (Linux 6.x, ext4 and others): 1 MiB of zeros in one write
// becomes folios of up to hundreds of KiB, and a folio is written back
// whole once any byte of it is dirty. Every sync then wrote each large
// folio the records since the last sync touched: a node on its own, 50
// clients sending one 256-byte SET each at a time, dirtied 6,325 bytes of
// page cache for each SET it logged in about 310 (a one-node cluster
// 13,768; Redis 458). Written in pieces about the size of the records
// that follow, each sync rewrites at most a piece at either end of what it
// adds: 3,238 bytes a SET on its own, 3,002 in a cluster, and pipelined
// (-P 16) 1,111 and 1,013 where whole 1 MiB writes cost 1,194 and 1,448
// (Redis 321), with the syncs as fast (docs/benchmarks.md, "What the zeros
// ahead cost the disk"; bench/diskbytes.sh).

// Zero pieces are between these sizes: below minZeroPiece a refill takes
// too many system calls; above maxZeroPiece the folios outgrow what
// small records need and bigger ones gain nothing (syncs of 100 KB entries
// over 128 KiB, 256 KiB and 512 KiB pieces took as long).
const (
	minZeroPiece = 64 << 10
	maxZeroPiece = 512 << 10
)

// ZeroPiece is the size of the pieces zeros are written in ahead of
// records written n bytes at a time: n rounded up to a power of two,
// within [minZeroPiece, maxZeroPiece].
func ZeroPiece(n int64) int64 {
	p := int64(minZeroPiece)
	for p < n && p < maxZeroPiece {
		p <<= 1
	}
	return p
}

var zeroSource = make([]byte, maxZeroPiece)

// WriteZeros writes zeros over [from, to) of f, one write per piece, each
// piece ending on a multiple of piece (a power of two: ZeroPiece) so that
// the folios the kernel makes for them are aligned and of that size.
func WriteZeros(f io.WriterAt, from, to, piece int64) error {
	piece = min(max(piece, 1), maxZeroPiece)
	for from < to {
		end := min((from/piece+1)*piece, to)
		if _, err := f.WriteAt(zeroSource[:end-from], from); err != nil {
			return err
		}
		from = end
	}
	return nil
}
