package journal

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"time"

	"github.com/hashicorp/raft"
)

// The file format. A segment is a header followed by records:
//
//	header: "MQKVJRNL" | version u32 | segment number u64
//	record: body length u32 | crc32c(kind | body) u32 | kind u8 | body
//
// All integers are little-endian. Every write batch ends with a commit
// record naming its own offset, its segment and where its batch began, and
// a batch counts only once its commit record is read back: what follows
// the last commit of the newest segment was never acknowledged (the fsync
// did not return) and is cut off at open. Record kinds are append-only: a kind, once released,
// keeps its number and its body for good.
const (
	magic      = "MQKVJRNL"
	version    = 1
	headerSize = len(magic) + 4 + 8
	recHeader  = 4 + 4 + 1

	kindEntry  = 1 // group u32 | index u64 | term u64 | type u8 | appended unix ns i64 | ext len u32 | ext | data
	kindDelete = 2 // group u32 | min u64 | max u64: entries min..max (inclusive) are gone
	kindStable = 3 // group u32 | key len u16 | key | value: raft's stable store
	kindDrop   = 4 // group u32: the group's entries and stable values are gone
	kindCommit = 5 // offset u64 | segment u64 | batch start u64: the batch from start to this record is durable
)

// maxRecord bounds one record's body: a raft entry carries at most a few
// MiB of commands (one command may be bigger, up to the store's value
// limit); anything larger is damage, not data.
const maxRecord = 1 << 30

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// errBadRecord reports bytes that are not a whole, intact record.
var errBadRecord = errors.New("journal: damaged or incomplete record")

func appendHeader(b []byte, seg uint64) []byte {
	b = append(b, magic...)
	b = binary.LittleEndian.AppendUint32(b, version)
	return binary.LittleEndian.AppendUint64(b, seg)
}

func checkHeader(b []byte) (seg uint64, err error) {
	if len(b) < headerSize || string(b[:len(magic)]) != magic {
		return 0, errors.New("journal: not a segment file")
	}
	if v := binary.LittleEndian.Uint32(b[len(magic):]); v != version {
		return 0, fmt.Errorf("journal: segment format %d is newer than this release understands (%d)", v, version)
	}
	return binary.LittleEndian.Uint64(b[len(magic)+4:]), nil
}

// beginRecord starts a record of the given kind at the end of b; finish it
// with endRecord(b, start) once its body is appended.
func beginRecord(b []byte, kind byte) ([]byte, int) {
	start := len(b)
	return append(b, 0, 0, 0, 0, 0, 0, 0, 0, kind), start
}

func endRecord(b []byte, start int) []byte {
	binary.LittleEndian.PutUint32(b[start:], uint32(len(b)-start-recHeader))
	binary.LittleEndian.PutUint32(b[start+4:], crc32.Checksum(b[start+8:], castagnoli))
	return b
}

func appendEntry(b []byte, g uint32, l *raft.Log) []byte {
	b, start := beginRecord(b, kindEntry)
	b = binary.LittleEndian.AppendUint32(b, g)
	b = binary.LittleEndian.AppendUint64(b, l.Index)
	b = binary.LittleEndian.AppendUint64(b, l.Term)
	b = append(b, byte(l.Type))
	var at int64
	if !l.AppendedAt.IsZero() {
		at = l.AppendedAt.UnixNano()
	}
	b = binary.LittleEndian.AppendUint64(b, uint64(at))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(l.Extensions)))
	b = append(b, l.Extensions...)
	b = append(b, l.Data...)
	return endRecord(b, start)
}

func appendDelete(b []byte, g uint32, min, max uint64) []byte {
	b, start := beginRecord(b, kindDelete)
	b = binary.LittleEndian.AppendUint32(b, g)
	b = binary.LittleEndian.AppendUint64(b, min)
	b = binary.LittleEndian.AppendUint64(b, max)
	return endRecord(b, start)
}

func appendStable(b []byte, g uint32, key, val []byte) []byte {
	b, start := beginRecord(b, kindStable)
	b = binary.LittleEndian.AppendUint32(b, g)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(key)))
	b = append(b, key...)
	b = append(b, val...)
	return endRecord(b, start)
}

func appendDrop(b []byte, g uint32) []byte {
	b, start := beginRecord(b, kindDrop)
	b = binary.LittleEndian.AppendUint32(b, g)
	return endRecord(b, start)
}

// commitSize is a commit record's length.
const commitSize = recHeader + 24

func appendCommit(b []byte, off int64, seg uint64, batch int64) []byte {
	b, start := beginRecord(b, kindCommit)
	b = binary.LittleEndian.AppendUint64(b, uint64(off))
	b = binary.LittleEndian.AppendUint64(b, seg)
	b = binary.LittleEndian.AppendUint64(b, uint64(batch))
	return endRecord(b, start)
}

// recordLen reads a record header: the whole record's length, given at
// least recHeader bytes. It does not check the body.
func recordLen(h []byte) int64 { return recHeader + int64(binary.LittleEndian.Uint32(h)) }

// checkRecord verifies a whole record (header and body) and returns its
// kind and body.
func checkRecord(r []byte) (kind byte, body []byte, err error) {
	if len(r) < recHeader || recordLen(r) != int64(len(r)) {
		return 0, nil, errBadRecord
	}
	if crc32.Checksum(r[8:], castagnoli) != binary.LittleEndian.Uint32(r[4:]) {
		return 0, nil, errBadRecord
	}
	return r[8], r[recHeader:], nil
}

// record is a decoded record. Entry data is a view into the read buffer.
type record struct {
	kind     byte
	group    uint32
	min, max uint64 // delete; for an entry, min is its index
	key, val []byte // stable
	log      raft.Log
	off      int64 // commit: the offset it names
	seg      uint64
	batch    int64 // commit: where its batch began
}

// decode parses a verified record's body.
func decode(kind byte, body []byte) (record, error) {
	r := record{kind: kind}
	le := binary.LittleEndian
	need := func(n int) bool { return len(body) >= n }
	switch kind {
	case kindEntry:
		const fixed = 4 + 8 + 8 + 1 + 8 + 4
		if !need(fixed) {
			return r, errBadRecord
		}
		r.group = le.Uint32(body)
		r.log.Index = le.Uint64(body[4:])
		r.min = r.log.Index
		r.log.Term = le.Uint64(body[12:])
		r.log.Type = raft.LogType(body[20])
		if at := int64(le.Uint64(body[21:])); at != 0 {
			r.log.AppendedAt = time.Unix(0, at)
		}
		ext := int(le.Uint32(body[29:]))
		if ext > len(body)-fixed {
			return r, errBadRecord
		}
		if ext > 0 {
			r.log.Extensions = body[fixed : fixed+ext]
		}
		r.log.Data = body[fixed+ext:]
	case kindDelete:
		if len(body) != 20 {
			return r, errBadRecord
		}
		r.group, r.min, r.max = le.Uint32(body), le.Uint64(body[4:]), le.Uint64(body[12:])
	case kindStable:
		if !need(6) {
			return r, errBadRecord
		}
		r.group = le.Uint32(body)
		n := int(le.Uint16(body[4:]))
		if n > len(body)-6 {
			return r, errBadRecord
		}
		r.key, r.val = body[6:6+n], body[6+n:]
	case kindDrop:
		if len(body) != 4 {
			return r, errBadRecord
		}
		r.group = le.Uint32(body)
	case kindCommit:
		if len(body) != 24 {
			return r, errBadRecord
		}
		r.off, r.seg, r.batch = int64(le.Uint64(body)), le.Uint64(body[8:]), int64(le.Uint64(body[16:]))
	default:
		return r, fmt.Errorf("journal: unknown record kind %d (written by a newer release?)", kind)
	}
	return r, nil
}
