package store

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io"
	"slices"

	"github.com/google/btree"

	"github.com/mqkv/mqkv/internal/hlc"
)

// Binary forms: a batch of commands (one replicated log entry) and a
// snapshot of the whole store. Both carry a format byte so later releases
// can read what earlier ones wrote.

// Batch formats, written into the log: a new format takes the next number
// and the old ones stay readable, since logs written by earlier releases
// are replayed.
//
// Format 2 carries the limits the leader enforces in every batch, so that
// replaying the log decides every quota as it was decided the first time,
// whatever the node's flags are now. Format 3 is format 2 followed by the
// CRC-32C of everything before it: the log store (raft-wal) checks only
// the newest batch, so without it a damaged entry further back would be
// applied as whatever it decodes to, or skipped. Format 4 is format 3
// with every command followed by its request (Command.Request, Keep):
// written only for a batch that has one, so a log without remembered
// requests stays readable by the releases before it.
const (
	batchFormatV2       = 2
	batchFormat         = 3
	batchFormatRequests = 4
)

// ErrCorrupt is returned for log entries and snapshots that cannot be read.
var ErrCorrupt = errors.New("store: corrupt data")

// AppendBatch appends the encoding of cmds, to be applied under limits, to b.
func AppendBatch(b []byte, limits Limits, cmds []Command) []byte {
	start := len(b)
	format := byte(batchFormat)
	for i := range cmds {
		if len(cmds[i].Request) > 0 {
			format = batchFormatRequests
			break
		}
	}
	b = append(b, format)
	b = binary.AppendUvarint(b, uint64(limits.MaxKeys))
	b = binary.AppendVarint(b, limits.MaxBytes)
	b = binary.AppendUvarint(b, uint64(len(cmds)))
	for i := range cmds {
		b = appendCommand(b, &cmds[i])
		if format == batchFormatRequests {
			b = appendRequest(b, &cmds[i])
		}
	}
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b[start:], castagnoli))
}

// AppendCommand appends one command's encoding, as a node forwarding a
// write to its group's leader sends it, to b: as a batch holds it,
// followed by its request if it has one.
func AppendCommand(b []byte, c *Command) []byte {
	b = appendCommand(b, c)
	if len(c.Request) > 0 {
		b = appendRequest(b, c)
	}
	return b
}

func appendRequest(b []byte, c *Command) []byte {
	b = appendBytes(b, c.Request)
	return binary.AppendVarint(b, c.Keep)
}

func appendCommand(b []byte, c *Command) []byte {
	b = append(b, byte(c.Op), byte(c.Cond))
	b = appendBytes(b, c.Key)
	b = appendBytes(b, c.Value)
	b = AppendTimestamp(b, c.Version)
	b = binary.AppendVarint(b, c.Now)
	if c.Op.keepsExpiry() {
		b = binary.AppendVarint(b, c.Delta) // in the TTL's place: they take none
	} else {
		b = binary.AppendVarint(b, c.TTL)
	}
	b = AppendTimestamp(b, c.Fence)
	return AppendTimestamp(b, c.Expected)
}

// DecodeCommand decodes what AppendCommand wrote, and nothing after it.
// Key and value alias data.
func DecodeCommand(data []byte) (Command, error) {
	d := decoder{b: data}
	var c Command
	d.command(&c)
	if d.err == nil && d.off < len(data) {
		d.request(&c)
		if len(c.Request) == 0 { // not how AppendCommand writes one
			d.err = ErrCorrupt
		}
	}
	if d.err != nil || d.off != len(data) {
		return Command{}, ErrCorrupt
	}
	return c, nil
}

// command reads one command.
func (d *decoder) command(c *Command) {
	c.Op = Op(d.byte())
	c.Cond = Cond(d.byte())
	c.Key = d.bytes()
	c.Value = d.bytes()
	c.Version = d.timestamp()
	c.Now = d.varint()
	c.TTL = d.varint()
	c.Fence = d.timestamp()
	c.Expected = d.timestamp()
	if c.Op.keepsExpiry() {
		c.Delta, c.TTL = c.TTL, 0
	}
	if c.Op < OpSet || c.Op > OpTouch || c.Cond > IfExists || !validCond(c) ||
		c.Op == OpPrepend && (c.Delta < 0 || c.Delta > int64(len(c.Value))) {
		d.err = ErrCorrupt
	}
}

// validCond says whether c's op takes c's condition: a SET any, a delete
// those before IfExists (as releases before it read them), an OpAppend
// Always or IfExists, an OpPrepend Always or NX, the other ops Always.
func validCond(c *Command) bool {
	switch c.Op {
	case OpSet:
		return true
	case OpDel, OpVDel, OpExpire:
		return c.Cond <= IfVersion
	case OpAppend:
		return c.Cond == Always || c.Cond == IfExists
	case OpPrepend:
		return c.Cond == Always || c.Cond == NX
	}
	return c.Cond == Always
}

// request reads a command's request (format 4).
func (d *decoder) request(c *Command) {
	c.Request = d.bytes()
	c.Keep = d.varint()
	if c.Keep < 0 || len(c.Request) == 0 && c.Keep != 0 {
		d.err = ErrCorrupt
	}
}

// VerifyBatch checks a log entry's checksum (format 3) or, for entries
// without one, that it decodes.
func VerifyBatch(data []byte) error {
	if len(data) > 0 && data[0] == batchFormatV2 {
		_, _, err := DecodeBatch(data)
		return err
	}
	_, err := batchBody(data)
	return err
}

// batchBody returns the part of a format 3 batch its checksum covers.
func batchBody(data []byte) ([]byte, error) {
	if len(data) < 5 || data[0] != batchFormat && data[0] != batchFormatRequests {
		return nil, fmt.Errorf("%w: unknown batch format", ErrCorrupt)
	}
	body := data[:len(data)-4]
	if crc32.Checksum(body, castagnoli) != binary.LittleEndian.Uint32(data[len(body):]) {
		return nil, fmt.Errorf("%w: checksum mismatch", ErrCorrupt)
	}
	return body, nil
}

// DecodeBatch decodes a batch written by AppendBatch. Keys and values alias
// data; Apply copies what it keeps.
func DecodeBatch(data []byte) (Limits, []Command, error) {
	if len(data) == 0 || data[0] != batchFormatV2 {
		body, err := batchBody(data)
		if err != nil {
			return Limits{}, nil, err
		}
		data = body
	}
	d := decoder{b: data}
	d.byte() // the format
	limits := decodedLimits(d.uvarint(), d.varint())
	n := d.uvarint()
	if n > uint64(len(data)) { // every command takes at least one byte
		return Limits{}, nil, ErrCorrupt
	}
	cmds := make([]Command, n)
	for i := range cmds {
		d.command(&cmds[i])
		if data[0] == batchFormatRequests {
			d.request(&cmds[i])
		}
	}
	if d.err != nil || d.off != len(data) {
		return Limits{}, nil, ErrCorrupt
	}
	return limits, cmds, nil
}

// decodedLimits is the Limits a batch's header holds.
func decodedLimits(maxKeys uint64, maxBytes int64) Limits {
	return Limits{MaxKeys: int(min(maxKeys, 1<<62)), MaxBytes: maxBytes}
}

// EncodedLimits is what DecodeBatch returns for the limits of a batch
// that AppendBatch wrote with l.
func EncodedLimits(l Limits) Limits { return decodedLimits(uint64(l.MaxKeys), l.MaxBytes) }

func appendBytes(b, s []byte) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// AppendTimestamp appends a version's encoding in a batch: Wall
// (varint), Counter (uvarint), Node (a uvarint length and the bytes).
func AppendTimestamp(b []byte, t hlc.Timestamp) []byte {
	b = binary.AppendVarint(b, t.Wall)
	b = binary.AppendUvarint(b, t.Counter)
	b = binary.AppendUvarint(b, uint64(len(t.Node)))
	return append(b, t.Node...)
}

// decoder reads the batch encoding; the first error sticks and later reads
// return zero values, so callers check once at the end.
type decoder struct {
	b        []byte
	off      int
	err      error
	lastNode string // see node
}

func (d *decoder) byte() byte {
	if d.err != nil || d.off >= len(d.b) {
		d.err = ErrCorrupt
		return 0
	}
	c := d.b[d.off]
	d.off++
	return c
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b[d.off:])
	if n <= 0 {
		d.err = ErrCorrupt
		return 0
	}
	d.off += n
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b[d.off:])
	if n <= 0 {
		d.err = ErrCorrupt
		return 0
	}
	d.off += n
	return v
}

func (d *decoder) bytes() []byte {
	l := d.uvarint()
	if d.err != nil || l > uint64(len(d.b)-d.off) {
		d.err = ErrCorrupt
		return nil
	}
	s := d.b[d.off : d.off+int(l) : d.off+int(l)]
	d.off += int(l)
	return s
}

func (d *decoder) timestamp() hlc.Timestamp {
	return hlc.Timestamp{Wall: d.varint(), Counter: d.uvarint(), Node: d.node()}
}

// node reads a version's node id. The versions of a log entry, or of a
// snapshot, nearly all name the same node: they share one string rather
// than one allocation each.
func (d *decoder) node() string {
	b := d.bytes()
	if len(b) == 0 {
		return "" // a zero timestamp (no fence, no expected version)
	}
	if string(b) != d.lastNode { // compared without a copy
		d.lastNode = string(b)
	}
	return d.lastNode
}

// Snapshot format:
//
//	"MQKVSNAP" | format u8 | max version | key count uvarint
//	| format 2: request count uvarint
//	| entries (key, value, version, fence, expiresAt)
//	| format 2: remembered requests (id, key, due (varint), outcome u8,
//	  version, flags u8 (bit 0 HadPrevious), previous)
//	| CRC-32C (4 bytes, big endian)
//
// The checksum covers every byte before it. Format 2 is written only by
// a store that remembers requests, so that the releases before it read
// the snapshots of a store that does not.
const (
	snapshotMagic          = "MQKVSNAP"
	snapshotFormat         = 1
	snapshotFormatRequests = 2
)

// WriteSnapshot writes every stored entry, and every remembered request,
// to w. Call it on a Clone so writes to the live store can go on
// meanwhile.
func (s *Store) WriteSnapshot(w io.Writer) error {
	sw, err := newSnapshotWriter(w, s.maxVersion, s.keys.Len(), s.requests.len())
	if err != nil {
		return err
	}
	s.keys.Ascend(func(e *Entry) bool {
		err = sw.Add(e)
		return err == nil
	})
	if err != nil {
		return err
	}
	s.rememberedOf(func(r *remembered) bool {
		err = sw.addRequest(r)
		return err == nil
	})
	if err != nil {
		return err
	}
	return sw.Close()
}

// SnapshotWriter writes a snapshot entry by entry, for a snapshot made of
// parts that are never in one store (a cluster's backup, group by group).
type SnapshotWriter struct {
	w       io.Writer
	crc     hash.Hash32
	bw      *bufio.Writer
	scratch []byte
	left    int    // entries still to come
	last    []byte // the last key written: keys must ascend
	// requestsLeft are the remembered requests still to come, after the
	// entries.
	requestsLeft int
}

// NewSnapshotWriter writes the head of a snapshot of count entries whose
// greatest version is maxVersion.
func NewSnapshotWriter(w io.Writer, maxVersion hlc.Timestamp, count int) (*SnapshotWriter, error) {
	return newSnapshotWriter(w, maxVersion, count, 0)
}

func newSnapshotWriter(w io.Writer, maxVersion hlc.Timestamp, count, requests int) (*SnapshotWriter, error) {
	crc := crc32.New(castagnoli)
	sw := &SnapshotWriter{w: w, crc: crc, bw: bufio.NewWriterSize(io.MultiWriter(w, crc), 64<<10), left: count, requestsLeft: requests}
	sw.scratch = append(sw.scratch, snapshotMagic...)
	if requests > 0 {
		sw.scratch = append(sw.scratch, snapshotFormatRequests)
	} else {
		sw.scratch = append(sw.scratch, snapshotFormat)
	}
	sw.scratch = AppendTimestamp(sw.scratch, maxVersion)
	sw.scratch = binary.AppendUvarint(sw.scratch, uint64(count))
	if requests > 0 {
		sw.scratch = binary.AppendUvarint(sw.scratch, uint64(requests))
	}
	_, err := sw.bw.Write(sw.scratch)
	return sw, err
}

// addRequest writes the next remembered request, once every entry was
// added.
func (sw *SnapshotWriter) addRequest(r *remembered) error {
	if sw.left != 0 || sw.requestsLeft == 0 {
		return errors.New("store: a remembered request out of the snapshot's place")
	}
	sw.requestsLeft--
	sw.scratch = appendBytes(sw.scratch[:0], []byte(r.id))
	sw.scratch = appendBytes(sw.scratch, r.key)
	sw.scratch = binary.AppendVarint(sw.scratch, r.at)
	sw.scratch = append(sw.scratch, byte(r.res.Outcome))
	sw.scratch = AppendTimestamp(sw.scratch, r.res.Version)
	var flags byte
	if r.res.HadPrevious {
		flags = 1
	}
	sw.scratch = append(sw.scratch, flags)
	sw.scratch = appendBytes(sw.scratch, r.res.Previous)
	_, err := sw.bw.Write(sw.scratch)
	return err
}

// Add writes the next entry; keys must ascend.
func (sw *SnapshotWriter) Add(e *Entry) error {
	if sw.left == 0 {
		return errors.New("store: more entries than the snapshot's count")
	}
	if sw.last != nil && bytes.Compare(e.Key, sw.last) <= 0 {
		return fmt.Errorf("store: snapshot keys out of order: %q after %q", e.Key, sw.last)
	}
	sw.left--
	sw.last = append(sw.last[:0], e.Key...)
	sw.scratch = appendBytes(sw.scratch[:0], e.Key)
	sw.scratch = appendBytes(sw.scratch, e.Value)
	sw.scratch = AppendTimestamp(sw.scratch, e.Version)
	sw.scratch = AppendTimestamp(sw.scratch, e.Fence)
	sw.scratch = binary.AppendVarint(sw.scratch, e.ExpiresAt)
	_, err := sw.bw.Write(sw.scratch)
	return err
}

// Close ends the snapshot with its checksum, once every entry was added.
func (sw *SnapshotWriter) Close() error {
	if sw.left != 0 || sw.requestsLeft != 0 {
		return fmt.Errorf("store: %d entries and %d requests short of the snapshot's counts", sw.left, sw.requestsLeft)
	}
	if err := sw.bw.Flush(); err != nil {
		return err
	}
	_, err := sw.w.Write(binary.BigEndian.AppendUint32(nil, sw.crc.Sum32()))
	return err
}

// ReadSnapshot replaces the contents of s with a snapshot read from r. On
// any error s is left unchanged.
func (s *Store) ReadSnapshot(r io.Reader) error {
	sr := &snapReader{r: bufio.NewReaderSize(r, 64<<10)}
	magic := sr.read(len(snapshotMagic))
	if sr.err == nil && string(magic) != snapshotMagic {
		return fmt.Errorf("%w: not a snapshot", ErrCorrupt)
	}
	format := sr.byte()
	if sr.err == nil && format != snapshotFormat && format != snapshotFormatRequests {
		return fmt.Errorf("%w: unknown snapshot format %d", ErrCorrupt, format)
	}
	maxVersion := sr.timestamp()
	n := sr.uvarint()
	var nreq uint64
	if format == snapshotFormatRequests {
		nreq = sr.uvarint()
	}
	keys := btree.NewG(degree, lessEntry)
	index := map[string]*Entry{}
	expiry := btree.NewG(degree, lessExpiry)
	var total int64
	serverKeys := 0
	for i := uint64(0); i < n && sr.err == nil; i++ {
		// Copies (the next read reuses the scratch buffer), apart, as set
		// stores them: an overwrite keeps the key's bytes.
		k := append([]byte(nil), sr.bytesField()...)
		v := sr.bytesField()
		e := &Entry{Key: k, Value: append(make([]byte, 0, len(v)), v...)}
		e.Version = sr.timestamp()
		e.Fence = sr.timestamp()
		e.ExpiresAt = sr.varint()
		if sr.err != nil {
			break
		}
		if _, dup := keys.ReplaceOrInsert(e); dup {
			sr.err = fmt.Errorf("%w: duplicate key", ErrCorrupt)
			break
		}
		index[keyString(e)] = e
		total += e.size()
		if Reserved(e.Key) {
			serverKeys++
		}
		if e.ExpiresAt != 0 {
			expiry.ReplaceOrInsert(expiryItem{at: e.ExpiresAt, key: e.Key})
		}
	}
	requests := newRequestTable()
	for i := uint64(0); i < nreq && sr.err == nil; i++ {
		r := &remembered{id: string(sr.bytesField())}
		r.key = append([]byte(nil), sr.bytesField()...)
		r.at = sr.varint()
		r.res.Outcome = Outcome(sr.byte())
		r.res.Version = sr.timestamp()
		flags := sr.byte()
		prev := sr.bytesField()
		if flags&1 != 0 {
			r.res.Previous, r.res.HadPrevious = append([]byte{}, prev...), true
		}
		switch {
		case sr.err != nil:
		case r.id == "" || r.res.Outcome > Overflow || flags > 1 || flags == 0 && len(prev) > 0:
			sr.err = errors.New("bad remembered request")
		case requests.index()[r.id] != nil:
			sr.err = errors.New("duplicate remembered request")
		default:
			requests.add(r)
		}
	}
	if sr.err != nil {
		return fmt.Errorf("%w: %v", ErrCorrupt, sr.err)
	}
	sum := sr.sum
	var tail [4]byte
	if _, err := io.ReadFull(sr.r, tail[:]); err != nil || binary.BigEndian.Uint32(tail[:]) != sum {
		return fmt.Errorf("%w: checksum mismatch", ErrCorrupt)
	}
	if _, err := sr.r.ReadByte(); err != io.EOF {
		return fmt.Errorf("%w: trailing data", ErrCorrupt)
	}
	s.keys, s.index, s.expiry, s.bytes, s.maxVersion = keys, index, expiry, total, maxVersion
	s.serverKeys, s.requests = serverKeys, requests
	return nil
}

// maxField bounds one key, value or node id read from a snapshot, so a
// corrupt length cannot make the reader allocate without bound.
const maxField = 1 << 30

// snapReader reads snapshot fields, hashing what it consumes.
type snapReader struct {
	r   *bufio.Reader
	sum uint32 // CRC-32C of the bytes read so far
	err error
	buf []byte
}

func (sr *snapReader) read(n int) []byte {
	if sr.err != nil {
		return nil
	}
	b := sr.buf[:0]
	for len(b) < n {
		// The buffer grows with the bytes that arrive, at most doubling:
		// a corrupt length must not allocate what the snapshot does not
		// hold (up to maxField at once, before).
		step := min(n-len(b), max(len(b), 1<<20))
		b = slices.Grow(b, step)
		m, err := io.ReadFull(sr.r, b[len(b):len(b)+step])
		b = b[:len(b)+m]
		if err != nil {
			sr.buf, sr.err = b[:0], err
			return nil
		}
	}
	sr.buf = b
	sr.sum = crc32.Update(sr.sum, castagnoli, b)
	return b
}

func (sr *snapReader) byte() byte {
	b := sr.read(1)
	if b == nil {
		return 0
	}
	return b[0]
}

func (sr *snapReader) uvarint() uint64 {
	if sr.err != nil {
		return 0
	}
	v, err := binary.ReadUvarint(hashingByteReader{sr})
	if err != nil {
		sr.err = err
	}
	return v
}

func (sr *snapReader) varint() int64 {
	if sr.err != nil {
		return 0
	}
	v, err := binary.ReadVarint(hashingByteReader{sr})
	if err != nil {
		sr.err = err
	}
	return v
}

// bytesField reads a length-prefixed field into the reader's scratch buffer;
// the result is valid until the next read.
func (sr *snapReader) bytesField() []byte {
	l := sr.uvarint()
	if sr.err == nil && l > maxField {
		sr.err = errors.New("field too long")
	}
	if sr.err != nil {
		return nil
	}
	return sr.read(int(l))
}

func (sr *snapReader) timestamp() hlc.Timestamp {
	wall := sr.varint()
	counter := sr.uvarint()
	node := string(sr.bytesField())
	return hlc.Timestamp{Wall: wall, Counter: counter, Node: node}
}

type hashingByteReader struct{ sr *snapReader }

func (h hashingByteReader) ReadByte() (byte, error) {
	c, err := h.sr.r.ReadByte()
	if err == nil {
		h.sr.sum = crc32.Update(h.sr.sum, castagnoli, []byte{c})
	}
	return c, err
}
