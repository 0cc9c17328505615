package memcache

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"os"
	"strconv"
	"time"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/resp"
)

// Flags: memcached keeps 32 bits with each value for its clients (their
// serialization format). A value stored with flags 0, what most clients
// send, is stored as it is, and reads the same over MQTT and RESP; other
// flags are kept in front of it behind flagsMagic. A value written another
// way that begins with flagsMagic would read with flags here: the magic
// starts with a zero byte and names mqkv, so no text value does.
var flagsMagic = []byte("\x00mqkv-mc\x01")

func encodeValue(flags uint32, data []byte) []byte {
	if flags == 0 {
		return data
	}
	b := make([]byte, 0, len(flagsMagic)+4+len(data))
	b = append(b, flagsMagic...)
	b = binary.BigEndian.AppendUint32(b, flags)
	return append(b, data...)
}

func decodeValue(stored []byte) (uint32, []byte) {
	if len(stored) >= len(flagsMagic)+4 && bytes.HasPrefix(stored, flagsMagic) {
		return binary.BigEndian.Uint32(stored[len(flagsMagic):]), stored[len(flagsMagic)+4:]
	}
	return 0, stored
}

// casUnique is the cas unique a client sees for a version: memcached's is
// a 64-bit number, a version is not (its clock, counter and node), so it
// is the version's 64-bit FNV-1a hash. cas compares it with the current
// version's and writes with that version as condition, so a change between
// the two is still caught.
func casUnique(v hlc.Timestamp) uint64 {
	h := fnv.New64a()
	h.Write(v.Append(nil))
	return h.Sum64()
}

// relativeLimit is memcached's rule: an exptime above 30 days is a unix
// time, below it seconds from now.
const relativeLimit = 30 * 24 * 3600

// pxOf turns an exptime into the store's PX (0: no expiry); a time in the
// past expires at once (a PX of 1 ms).
func pxOf(exptime int64) int64 {
	switch {
	case exptime == 0:
		return 0
	case exptime < 0:
		return 1
	case exptime > relativeLimit:
		return max(exptime*1000-time.Now().UnixMilli(), 1)
	}
	return exptime * 1000
}

func (c *conn) line(s string) { c.bw.WriteString(s + "\r\n") }

// reply writes s unless the client said noreply.
func (c *conn) reply(r *request, s string) {
	if !r.noreply {
		c.line(s)
	}
}

// fail writes the store's error as memcached words it.
func (c *conn) fail(r *request, v resp.Value) {
	if r.noreply {
		return
	}
	if string(v.Str) == string(resp.ErrNotAuthorized) {
		c.line("CLIENT_ERROR not authorized")
		return
	}
	c.line("SERVER_ERROR " + string(v.Str))
}

func (c *conn) call(args ...[]byte) (resp.Value, hlc.Timestamp) { return c.c.Call("", args...) }

func isErr(v resp.Value) bool { return v.Kind == resp.ErrorReply }

// notApplied is the store's answer to a write whose condition failed.
func notApplied(v resp.Value) bool { return v.Kind == resp.Integer && v.Int == -1 }

func (c *conn) run(r *request) {
	switch r.name {
	case "get", "gets":
		c.get(r)
	case "set", "add":
		c.store(r)
	case "replace", "append", "prepend", "touch":
		c.change(r)
	case "cas":
		c.s.stats.sets.Add(1)
		c.update(r)
	case "incr", "decr":
		c.count(r)
	case "delete":
		c.delete(r)
	case "version":
		c.line("VERSION " + c.info().Version)
	case "verbosity":
		c.reply(r, "OK")
	case "stats":
		c.statsReply(r)
	case "flush_all":
		c.line("CLIENT_ERROR flush_all is not supported by mqkv: the store is shared with MQTT and Redis clients")
	}
}

func (c *conn) get(r *request) {
	for _, k := range r.keys {
		c.s.stats.gets.Add(1)
		v, ver := c.call([]byte("GET"), k)
		if isErr(v) {
			c.fail(r, v)
			return
		}
		if v.Null {
			c.s.stats.misses.Add(1)
			continue
		}
		c.s.stats.hits.Add(1)
		flags, data := decodeValue(v.Str)
		fmt.Fprintf(c.bw, "VALUE %s %d %d", k, flags, len(data))
		if r.name == "gets" {
			fmt.Fprintf(c.bw, " %d", casUnique(ver))
		}
		c.bw.WriteString("\r\n")
		c.bw.Write(data)
		c.bw.WriteString("\r\n")
	}
	c.line("END")
}

// store serves set and add.
func (c *conn) store(r *request) {
	c.s.stats.sets.Add(1)
	cmd := [][]byte{[]byte("SET"), r.keys[0], encodeValue(r.flags, r.data)}
	if r.name == "add" {
		cmd = append(cmd, []byte("NX"))
	}
	if px := pxOf(r.exptime); px > 0 {
		cmd = append(cmd, []byte("PX"), strconv.AppendInt(nil, px, 10))
	}
	v, _ := c.call(cmd...)
	switch {
	case isErr(v):
		c.fail(r, v)
	case notApplied(v):
		c.reply(r, "NOT_STORED")
	default:
		c.reply(r, "STORED")
	}
}

// current is a key as it is: its value, version and remaining time to
// live in ms (0: none), read so that all three belong to one version.
type current struct {
	value   []byte
	version hlc.Timestamp
	px      int64
}

// read reads key's current state; found is false if it has none. A change
// between the two reads is read again.
func (c *conn) read(key []byte) (cur current, found bool, errv *resp.Value) {
	for range 16 {
		t, tver := c.call([]byte("PTTL"), key)
		if isErr(t) {
			return cur, false, &t
		}
		if t.Int == -2 {
			return cur, false, nil
		}
		v, ver := c.call([]byte("GET"), key)
		if isErr(v) {
			return cur, false, &v
		}
		if v.Null {
			return cur, false, nil
		}
		if ver != tver {
			continue
		}
		px := int64(0) // -1: no expiry
		if t.Int >= 0 {
			px = max(t.Int, 1) // 0: expiring this millisecond
		}
		cur = current{value: v.Str, version: ver, px: px}
		return cur, true, nil
	}
	e := resp.Value{Kind: resp.ErrorReply, Str: []byte("the key changed too often to be read; try again")}
	return cur, false, &e
}

// update serves cas, and the other commands that change what a key holds
// in a cluster whose members do not all apply them (see change, count):
// each reads the key and writes on condition that its version is still
// the one read (VER), again if another write came between. Its caller
// counts it in the stats.
func (c *conn) update(r *request) {
	key := r.keys[0]
	for range 16 {
		cur, found, errv := c.read(key)
		if c.answered(r, found, errv) {
			return
		}
		flags, data := decodeValue(cur.value)
		px := cur.px
		var reply string
		switch r.name {
		case "replace":
			flags, data, px = r.flags, r.data, pxOf(r.exptime)
			reply = "STORED"
		case "append":
			data, reply = append(data[:len(data):len(data)], r.data...), "STORED"
		case "prepend":
			data, reply = append(r.data[:len(r.data):len(r.data)], data...), "STORED"
		case "cas":
			if casUnique(cur.version) != r.cas {
				c.s.stats.casBad.Add(1)
				c.reply(r, "EXISTS")
				return
			}
			flags, data, px = r.flags, r.data, pxOf(r.exptime)
			reply = "STORED"
		case "touch":
			px, reply = pxOf(r.exptime), "TOUCHED"
		case "incr", "decr": // a cluster not yet at the counters' protocol (see count)
			n, err := strconv.ParseUint(string(data), 10, 64)
			if err != nil {
				if !r.noreply {
					c.line("CLIENT_ERROR cannot increment or decrement non-numeric value")
				}
				return
			}
			if r.name == "incr" {
				n += r.delta // wraps at 2^64, as memcached's
			} else {
				n -= min(n, r.delta) // stops at 0
			}
			data = strconv.AppendUint(nil, n, 10)
			reply = string(data)
		}
		cmd := [][]byte{[]byte("SET"), key, encodeValue(flags, data), []byte("VER"), cur.version.Append(nil)}
		if px > 0 {
			cmd = append(cmd, []byte("PX"), strconv.AppendInt(nil, px, 10))
		}
		v, _ := c.call(cmd...)
		switch {
		case isErr(v):
			c.fail(r, v)
			return
		case notApplied(v):
			if r.name == "cas" {
				c.s.stats.casBad.Add(1)
				c.reply(r, "EXISTS") // changed since the client read it
				return
			}
			continue // changed since read: again
		}
		c.hit(r)
		c.reply(r, reply)
		return
	}
	if !r.noreply {
		c.line("SERVER_ERROR the key changed too often; try again")
	}
}

// change serves replace, append, prepend and touch each as one write
// that the log applies to whatever the key holds then (SET ... XX, APPEND
// ... XX, PREPEND, PEXPIRE or PERSIST), so that concurrent ones all take
// effect, as they do in memcached: read and written back on condition
// (VER), as update does, the many clients' changes of one key failed
// "the key changed too often" (as its incr did, issue 32). prepend reads
// the key's flags first, its data going after them (PREPEND ... PREFIX),
// or first where there are none (UNLESS: the value must not begin with
// flags); flags changed in between are read again. In a cluster whose
// members do not all apply these yet (a rolling upgrade), it goes as
// update does.
func (c *conn) change(r *request) {
	key := r.keys[0]
	if r.name == "touch" {
		c.s.stats.touches.Add(1)
	} else {
		c.s.stats.sets.Add(1)
	}
	var f uint32
	if r.name == "prepend" {
		var found bool
		var errv *resp.Value
		if f, found, errv = c.flagsOf(key); c.answered(r, found, errv) {
			return
		}
	}
	for range 16 {
		var cmd [][]byte
		reply := "STORED"
		switch r.name {
		case "replace":
			cmd = [][]byte{[]byte("SET"), key, encodeValue(r.flags, r.data), []byte("XX")}
			if px := pxOf(r.exptime); px > 0 {
				cmd = append(cmd, []byte("PX"), strconv.AppendInt(nil, px, 10))
			}
		case "append":
			cmd = [][]byte{[]byte("APPEND"), key, r.data, []byte("XX")}
		case "prepend":
			if f != 0 {
				cmd = [][]byte{[]byte("PREPEND"), key, r.data, []byte("PREFIX"), encodeValue(f, nil)}
			} else {
				cmd = [][]byte{[]byte("PREPEND"), key, r.data, []byte("UNLESS"), flagsMagic}
			}
		case "touch":
			reply = "TOUCHED"
			if px := pxOf(r.exptime); px > 0 {
				cmd = [][]byte{[]byte("PEXPIRE"), key, strconv.AppendInt(nil, px, 10)}
			} else {
				cmd = [][]byte{[]byte("PERSIST"), key}
			}
		}
		v, _ := c.call(cmd...)
		switch {
		case isErr(v) && string(v.Str) == string(resp.ErrValueOpsProtocol):
			c.update(r) // counted above
		case isErr(v):
			c.fail(r, v)
		case v.Null || r.name == "touch" && v.Int == 0 || r.name == "replace" && notApplied(v):
			c.missing(r) // no key (touch: 0; replace: not set)
		case notApplied(v): // prepend: other flags than read
			was := f
			var found bool
			var errv *resp.Value
			if f, found, errv = c.flagsOf(key); c.answered(r, found, errv) {
				return
			}
			if f == was {
				// The same flags: a value that begins as a header does
				// but is none (written over RESP or MQTT), which the
				// condition never passes. Read and written on condition.
				c.update(r)
				return
			}
			continue
		default:
			c.hit(r)
			c.reply(r, reply)
		}
		return
	}
	if !r.noreply {
		c.line("SERVER_ERROR the key changed too often; try again")
	}
}

// count serves incr and decr as INCRBY or DECRBY ... UNSIGNED, which the
// log applies to whatever the key holds then, so that concurrent ones all
// count: read and written back on condition (VER), as update does, most
// of 50 clients' increments of one key failed, answered "the key changed
// too often" (issue 32). The key is read first for its flags only, which
// the value holds before the number (PREFIX); flags changed in between
// are read again. In a cluster whose members do not all apply counters
// yet (a rolling upgrade), it counts as update does.
func (c *conn) count(r *request) {
	verb := []byte("INCRBY")
	if r.name == "decr" {
		verb = []byte("DECRBY")
	}
	delta := strconv.AppendUint(nil, r.delta, 10)
	f, found, errv := c.flagsOf(r.keys[0])
	for range 16 {
		if c.answered(r, found, errv) {
			return
		}
		cmd := [][]byte{verb, r.keys[0], delta, []byte("UNSIGNED")}
		if f != 0 {
			cmd = append(cmd, []byte("PREFIX"), encodeValue(f, nil))
		}
		n, _ := c.call(cmd...)
		if isErr(n) && string(n.Str) == string(resp.ErrArithmeticProtocol) {
			c.update(r)
			return
		}
		if isErr(n) && string(n.Str) == string(resp.ErrNotInteger) {
			// Not a number, or flags set (or the key gone) since they
			// were read.
			was := f
			if f, found, errv = c.flagsOf(r.keys[0]); errv != nil || !found || f != was {
				continue
			}
			if !r.noreply {
				c.line("CLIENT_ERROR cannot increment or decrement non-numeric value")
			}
			return
		}
		switch {
		case isErr(n):
			c.fail(r, n)
			return
		case n.Null:
			c.missing(r)
			return
		case notApplied(n): // other flags than read
			f, found, errv = c.flagsOf(r.keys[0])
			continue
		}
		c.hit(r)
		c.reply(r, string(n.Str))
		return
	}
	if !r.noreply {
		c.line("SERVER_ERROR the key changed too often; try again")
	}
}

// flagsOf reads the flags key's value holds (found false: no key), for
// the commands that keep them in front of what they change (prepend,
// incr, decr).
func (c *conn) flagsOf(key []byte) (flags uint32, found bool, errv *resp.Value) {
	v, _ := c.call([]byte("GET"), key)
	if isErr(v) {
		return 0, false, &v
	}
	flags, _ = decodeValue(v.Str)
	return flags, !v.Null, nil
}

// answered answers an update whose read of the key failed (errv) or
// found none, and says whether it did.
func (c *conn) answered(r *request, found bool, errv *resp.Value) bool {
	switch {
	case errv != nil:
		c.fail(r, *errv)
	case !found:
		c.missing(r)
	default:
		return false
	}
	return true
}

// missing answers an update of a key that does not exist.
func (c *conn) missing(r *request) {
	switch r.name {
	case "replace", "append", "prepend":
		c.reply(r, "NOT_STORED")
	case "cas":
		c.s.stats.casMisses.Add(1)
		c.reply(r, "NOT_FOUND")
	case "incr":
		c.s.stats.incrMisses.Add(1)
		c.reply(r, "NOT_FOUND")
	case "decr":
		c.s.stats.decrMisses.Add(1)
		c.reply(r, "NOT_FOUND")
	default:
		c.reply(r, "NOT_FOUND")
	}
}

func (c *conn) hit(r *request) {
	switch r.name {
	case "cas":
		c.s.stats.casHits.Add(1)
	case "incr":
		c.s.stats.incrHits.Add(1)
	case "decr":
		c.s.stats.decrHits.Add(1)
	}
}

func (c *conn) delete(r *request) {
	v, _ := c.call([]byte("DEL"), r.keys[0])
	switch {
	case isErr(v):
		c.fail(r, v)
	case v.Int == 1:
		c.s.stats.deleteHits.Add(1)
		c.reply(r, "DELETED")
	default:
		c.s.stats.deleteMisses.Add(1)
		c.reply(r, "NOT_FOUND")
	}
}

func (c *conn) info() Info {
	if c.s.cfg.Info == nil {
		return Info{Version: "mqkv"}
	}
	return c.s.cfg.Info()
}

// statsReply serves "stats" (general statistics; other groups are empty).
func (c *conn) statsReply(r *request) {
	if len(r.keys) > 0 {
		c.line("END")
		return
	}
	in := c.info()
	st := &c.s.stats
	now := time.Now()
	for _, kv := range []struct {
		k string
		v any
	}{
		{"pid", os.Getpid()}, {"uptime", int64(now.Sub(in.Started).Seconds())}, {"time", now.Unix()},
		{"version", in.Version}, {"pointer_size", 64},
		{"curr_connections", st.connected.Load()}, {"total_connections", st.total.Load()},
		{"cmd_get", st.gets.Load()}, {"cmd_set", st.sets.Load()}, {"cmd_touch", st.touches.Load()},
		{"get_hits", st.hits.Load()}, {"get_misses", st.misses.Load()},
		{"delete_hits", st.deleteHits.Load()}, {"delete_misses", st.deleteMisses.Load()},
		{"incr_hits", st.incrHits.Load()}, {"incr_misses", st.incrMisses.Load()},
		{"decr_hits", st.decrHits.Load()}, {"decr_misses", st.decrMisses.Load()},
		{"cas_hits", st.casHits.Load()}, {"cas_misses", st.casMisses.Load()}, {"cas_badval", st.casBad.Load()},
		{"curr_items", in.Keys}, {"bytes", in.Bytes}, {"limit_maxbytes", 0}, {"threads", 1},
	} {
		fmt.Fprintf(c.bw, "STAT %s %v\r\n", kv.k, kv.v)
	}
	c.line("END")
}
