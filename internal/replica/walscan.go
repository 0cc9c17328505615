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
	walFrameEntry  = 1
	walFrameIndex  = 2
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
	torn, err := scanTail(data)
	if err != nil {
		return &DamagedError{Path: tail, What: "the newest raft log segment", Err: err}
	}
	if torn[1] > torn[0] {
		// raft-wal writes its next batch over a torn one, not over zeros:
		// clear it, so that a sector of that batch lost in another crash
		// reads as zeros again (see journal.SectorsWritten), not as this.
		return zeroRange(tail, torn[0], torn[1])
	}
	return nil
}

// scanTail judges the newest segment's data: damage that raft-wal would
// drop without a word, or else the torn write it drops, [torn[0], torn[1])
// (empty if none).
func scanTail(data []byte) (torn [2]int, err error) {
	end, lastCommit := walkFrames(data)
	if n := completeBatchesAfter(data, lastCommit); n > 0 {
		return torn, fmt.Errorf("the frame at byte %d cannot be read, and %d complete, checksummed batch(es) of entries follow it: they would be lost", end, n)
	}
	// What raft-wal drops, [keep, stop), is a torn write, never
	// acknowledged, unless it is a batch that reached the disk whole (see
	// wholeBatch): then a bit flipped at rest is what makes it fail, and
	// the batch was acknowledged.
	keep, from := walTail(data)
	stop := len(data)
	for stop > keep && data[stop-1] == 0 {
		stop--
	}
	if stop <= keep {
		return torn, nil // zeros after what raft-wal keeps: the usual case
	}
	stop = min(len(data), (stop+walFrameHeader-1)/walFrameHeader*walFrameHeader)
	if wholeBatch(data, keep, from, stop) {
		return torn, fmt.Errorf("the last batch of entries (bytes %d to %d) was written whole but does not read: it would be lost", keep, stop)
	}
	return [2]int{keep, stop}, nil
}

// maxRepair and maxRepairFrames bound the batches wholeBatch tries to mend
// a header of (64 walks per header), maxRepairSums the checksums of the
// batch it computes for mends whose walk ends at its commit frame: a
// damaged torn tail, or one made so, must not hold a start up for long.
// raft writes at most MaxAppendEntries (64) entries in a batch.
const (
	maxRepair       = 16 << 20
	maxRepairFrames = 256
	maxRepairSums   = 16
)

// wholeBatch reports whether [keep, stop), which raft-wal drops, is a
// batch that reached the disk whole but was damaged at rest. A disk keeps
// or loses a sector whole, and the batch was written over zeros, so a
// torn one shows a sector's share of zeros (journal.SectorsWritten); and
// it must end in its own commit frame, found by walking its frames from
// keep (a word that merely looks like a commit frame, inside an entry a
// crash cut short, is not one). The damage is one of: a flipped bit in an
// entry (the commit frame is there, the checksum fails), in the commit
// frame's type (the checksum matches), or in a frame header the walk
// cannot get past, which one bit flipped back mends (the walk then ends
// at the commit frame and the checksum matches).
func wholeBatch(data []byte, keep, from, stop int) bool {
	c := stop - walFrameHeader
	if c < keep || data[c+1]|data[c+2]|data[c+3] != 0 || !journal.SectorsWritten(data, int64(keep), int64(stop)) {
		return false
	}
	sum := binary.LittleEndian.Uint32(data[c+4:])
	if walkTo(data, keep, c, len(data), nil) == c {
		return data[c] == walFrameCommit || crc32.Checksum(data[from:c], castagnoli) == sum
	}
	var headers []int
	walkTo(data, keep, c, maxRepairFrames+1, func(off int) { headers = append(headers, off) })
	if c-from > maxRepair || len(headers) > maxRepairFrames {
		return false
	}
	// Any header the walk read may be the damaged one: a length a bit too
	// short lands the walk inside the entry's own payload, where it reads
	// on or stops. The checksum is computed only for a walk that ends at c,
	// and at most maxRepairSums times: one mend in 64 per header ends there
	// in a real batch; data made to end there often is not one.
	sums := 0
	for _, p := range headers {
		for bit := range 64 {
			data[p+bit/8] ^= 1 << (bit % 8)
			mended := false
			if walkTo(data, keep, c, maxRepairFrames, nil) == c && sums < maxRepairSums {
				sums++
				mended = crc32.Checksum(data[from:c], castagnoli) == sum
			}
			data[p+bit/8] ^= 1 << (bit % 8)
			if mended {
				return true
			}
		}
	}
	return false
}

// walkTo walks frames from off as raft-wal reads them, up to c and at most
// max frames, calling visit (if set) with each frame header's offset. It
// returns where it ends: c, past it, at a header it cannot decode, or -1
// after max frames.
func walkTo(data []byte, off, c, max int, visit func(int)) int {
	for frames := 0; off < c; frames++ {
		if frames == max {
			return -1
		}
		if visit != nil {
			visit(off)
		}
		switch data[off] {
		case walFrameEntry, walFrameIndex:
			n := int(binary.LittleEndian.Uint32(data[off+4:]))
			off += walFrameHeader + n + (walFrameHeader-n%walFrameHeader)%walFrameHeader
		case walFrameCommit:
			off += walFrameHeader
		default:
			return off
		}
	}
	return off
}

// walTail mirrors how raft-wal recovers its newest segment (readThroughSegment
// and recoverTail, v0.4.1): its writer resumes at keep, dropping what
// follows; the checksum of the batch after keep begins at from.
func walTail(data []byte) (keep, from int) {
	last, prev := -1, -1
	entriesAfter := false // entry frames after the last commit frame
	// Every frame whose header fits in the data, to the first that does
	// not decode (zeros, at the end of what was written).
	walkTo(data, walFileHeader, len(data)-walFrameHeader+1, len(data), func(off int) {
		switch data[off] {
		case walFrameEntry:
			entriesAfter = true
		case walFrameCommit:
			prev, last, entriesAfter = last, off, false
		}
	})
	if last < 0 {
		return walFileHeader, 0 // no commit: the segment starts over
	}
	start := 0 // the first batch's checksum covers the file header
	if prev >= 0 {
		start = prev + walFrameHeader
	}
	if entriesAfter || crc32.Checksum(data[start:last], castagnoli) == binary.LittleEndian.Uint32(data[last+4:]) {
		return last + walFrameHeader, last + walFrameHeader
	}
	if prev < 0 {
		return walFileHeader, 0
	}
	return start, start
}

// zeroRange writes zeros over [from, to) of the file at path, durably.
func zeroRange(path string, from, to int) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.WriteAt(make([]byte, to-from), int64(from)); err != nil {
		return err
	}
	return journal.Datasync(f)
}

// walkFrames returns where raft-wal's reading of a segment stops (the
// first frame header that is zero or does not decode) and the offset of
// the last commit frame before it (-1 if none).
func walkFrames(data []byte) (stop, lastCommit int) {
	off, lastCommit := walFileHeader, -1
	for off+walFrameHeader <= len(data) {
		h := data[off : off+walFrameHeader]
		if h[0] == 0 || h[0] > walFrameCommit || h[1]|h[2]|h[3] != 0 {
			return off, lastCommit
		}
		n := 0
		if h[0] == walFrameCommit {
			lastCommit = off
		} else {
			n = int(binary.LittleEndian.Uint32(h[4:]))
			n += (walFrameHeader - n%walFrameHeader) % walFrameHeader
		}
		off += walFrameHeader + n
	}
	return min(off, len(data)), lastCommit
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
