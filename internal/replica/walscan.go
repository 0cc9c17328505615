package replica

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"

	"github.com/mqkv/mqkv/internal/journal"
)

// raft-wal's segment format, as far as checkTail needs it: a 32-byte file
// header, then frames of an 8-byte header (type, three zero bytes, then a
// little-endian length, or for a commit frame the CRC-32C of the batch it
// closes) and a payload padded to 8 bytes.
const (
	walFileHeader  = 32
	walFrameHeader = 8
	walFrameCommit = 3
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// checkTail looks for acknowledged batches that raft-wal would silently
// drop. Opening a log, raft-wal reads the newest segment frame by frame
// and takes the first frame it cannot decode for the end of a torn write,
// keeping what comes before. A torn write can only be the last batch, which
// was never acknowledged; but a damaged frame header earlier in the segment
// would end the log there and throw away every later batch, which were.
// So before the log is opened (raft-wal would overwrite them with the
// next append), the rest of the segment after that point is searched for
// a complete batch: two commit frames of which the second carries the
// checksum of the bytes between them. If there is one, the log is
// damaged, not torn.
func checkTail(walDir string) error {
	segs, err := filepath.Glob(filepath.Join(walDir, "*.wal"))
	if err != nil || len(segs) == 0 {
		return nil
	}
	slices.Sort(segs) // named by base index, zero-padded: the newest last
	tail := segs[len(segs)-1]
	data, err := os.ReadFile(tail)
	if err != nil {
		return &DamagedError{Path: tail, What: "the newest raft log segment", Err: err}
	}
	end, lastCommit, prevCommit := walkFrames(data)
	if n := completeBatchesAfter(data, lastCommit); n > 0 {
		return &DamagedError{Path: tail, What: "the newest raft log segment", Err: fmt.Errorf(
			"the frame at byte %d cannot be read, and %d complete, checksummed batch(es) of entries follow it: they would be lost", end, n)}
	}
	// raft-wal drops a last batch that fails its checksum as a torn write.
	// One that reached the disk whole was acknowledged: that is damage.
	if lastCommit >= 0 && end == lastCommit+walFrameHeader {
		start := 0 // the first batch's checksum covers the file header
		if prevCommit >= 0 {
			start = prevCommit + walFrameHeader
		}
		sum := binary.LittleEndian.Uint32(data[lastCommit+4:])
		if crc32.Checksum(data[start:lastCommit], castagnoli) != sum && journal.SectorsWritten(data, int64(start), int64(end)) {
			return &DamagedError{Path: tail, What: "the newest raft log segment", Err: fmt.Errorf(
				"the last batch of entries (bytes %d to %d) fails its checksum, though all of it was written: it would be lost", start, end)}
		}
	}
	return nil
}

// walkFrames returns where raft-wal's reading of a segment stops (the
// first frame header that is zero or does not decode) and the offsets of
// the last two commit frames before it (-1 if none).
func walkFrames(data []byte) (stop, lastCommit, prevCommit int) {
	off, lastCommit, prevCommit := walFileHeader, -1, -1
	for off+walFrameHeader <= len(data) {
		h := data[off : off+walFrameHeader]
		if h[0] == 0 || h[0] > walFrameCommit || h[1]|h[2]|h[3] != 0 {
			return off, lastCommit, prevCommit
		}
		n := 0
		if h[0] == walFrameCommit {
			prevCommit, lastCommit = lastCommit, off
		} else {
			n = int(binary.LittleEndian.Uint32(h[4:]))
			n += (walFrameHeader - n%walFrameHeader) % walFrameHeader
		}
		off += walFrameHeader + n
	}
	return min(off, len(data)), lastCommit, prevCommit
}

// pairWindow is how many earlier commit-frame candidates each candidate is
// checked against: bytes in an entry's payload can look like a commit
// frame header, and one such false candidate between two real commit
// frames must not hide the batch between them.
const pairWindow = 16

// completeBatchesAfter counts the complete batches after the last commit
// frame the reading passed (lastCommit, -1 if none): commit frames whose
// checksum matches the bytes since an earlier commit frame. A damaged
// length can make the reading jump past real commit frames, into the
// zeros written ahead: so all that follows lastCommit is searched, not
// only what follows the point where the reading stopped.
func completeBatchesAfter(data []byte, lastCommit int) int {
	start, tail := walFileHeader, walFileHeader
	if lastCommit >= 0 {
		start, tail = lastCommit, lastCommit+walFrameHeader
	}
	if !slices.ContainsFunc(data[min(tail, len(data)):], func(b byte) bool { return b != 0 }) {
		return 0 // zeros to the end: the usual case
	}
	var cands []int // commit-frame candidates, from start on
	n := 0
	for c := start; c+walFrameHeader <= len(data); c += walFrameHeader {
		if data[c] != walFrameCommit || data[c+1]|data[c+2]|data[c+3] != 0 {
			continue
		}
		if c > lastCommit {
			sum := binary.LittleEndian.Uint32(data[c+4:])
			for _, p := range cands[max(0, len(cands)-pairWindow):] {
				if crc32.Checksum(data[p+walFrameHeader:c], castagnoli) == sum {
					n++
					break
				}
			}
		}
		cands = append(cands, c)
	}
	return n
}
