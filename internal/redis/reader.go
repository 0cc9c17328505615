package redis

import (
	"bufio"
	"bytes"
	"io"
	"math"
	"strconv"

	"github.com/mqkv/mqkv/internal/gateway"
)

// Limits on what one command may hold: a client is answered with a
// protocol error and disconnected beyond them, as Redis does.
const (
	maxArgs   = 1 << 16 // elements of one command (MGET, DEL of many keys)
	maxInline = 64 << 10
)

// ProtocolError is input that is not RESP: Redis answers "-ERR Protocol
// error: ..." and closes the connection, and so does mqkv.
type ProtocolError string

func (e ProtocolError) Error() string { return "Protocol error: " + string(e) }

// reader reads commands off a connection.
//
// A command's arguments, up to maxCarved bytes each, are carved out of a
// slab shared by the commands that follow (a new one once it is used
// up), and their slice is reused from one command to the next: three
// allocations per SET fewer. So an argument's bytes stay as read for as
// long as anything holds them (a write in flight, its key), but the slice
// holding them is only the caller's until the next command is read.
type reader struct {
	br      *bufio.Reader
	maxBulk int
	args    [][]byte
	slab    []byte
	src     bytes.Reader // what br reads from, for the loop's connections (see feed)
}

// readerSize is the reader's buffer: a line (a number) that does not fit
// in it is refused.
const readerSize = 16 << 10

// feed makes b, which commandLen measured, what the reader reads next:
// a connection of the loop is read by the loop, not through its reader.
func (r *reader) feed(b []byte) {
	r.src.Reset(b)
	r.br.Reset(&r.src)
}

// commandLen says how much of b, the start of a connection's unread
// input, the reader must be fed for its next command: all of it when b
// holds the command whole; when b shows it malformed or over a limit, as
// far as the reader goes to find the same error it finds reading the
// connection; 0 while b holds too little to tell.
func commandLen(b []byte, maxBulk int) int {
	if len(b) == 0 {
		return 0
	}
	if b[0] != '*' {
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			return i + 1
		}
		if len(b) > maxInline+2 {
			return len(b) // too big an inline request
		}
		return 0
	}
	at := lineEnd(b, 1)
	if at <= 0 {
		return -at
	}
	count, ok := parseNumber(b[1:at])
	if !ok || count > maxArgs || count <= 0 {
		return at
	}
	for range count {
		if at >= len(b) {
			return 0
		}
		if b[at] != '$' {
			return at + 1
		}
		end := lineEnd(b, at+1)
		if end <= 0 {
			return -end
		}
		l, ok := parseNumber(b[at+1 : end])
		if !ok || l < 0 || l > maxBulk {
			return end
		}
		at = end + l + 2
		if at > len(b) {
			return 0
		}
		if b[at-2] != '\r' || b[at-1] != '\n' {
			return at // not ended by CRLF
		}
	}
	return at
}

// lineEnd finds the end of the line that starts at from (after its kind
// byte): the offset just past its LF, or, when b holds no LF, minus what
// to feed the reader: all of b once the line could not fit in the
// reader's buffer (the reader refuses it), else 0 (wait for more).
func lineEnd(b []byte, from int) int {
	i := bytes.IndexByte(b[from:], '\n')
	if i < 0 {
		if len(b)-from >= readerSize {
			return -len(b)
		}
		return 0
	}
	return from + i + 1
}

// Carving arguments out of slabs: small ones only, so that a large value
// gets its own buffer, and a slab kept alive by one argument holds little.
const (
	maxCarved = 1 << 10
	slabSize  = 16 << 10
)

// next reads one command: a RESP array of bulk strings, or an inline
// command (a line of words, as typed into telnet). An empty command (a
// blank line, "*0") is returned as no arguments and no error.
func (r *reader) next() ([][]byte, error) {
	c, err := r.br.Peek(1)
	if err != nil {
		return nil, err
	}
	if c[0] != '*' {
		return r.inline()
	}
	r.br.Discard(1)
	n, err := r.number('*')
	if err != nil {
		return nil, err
	}
	if n > maxArgs {
		return nil, ProtocolError("invalid multibulk length")
	}
	if n <= 0 {
		return nil, nil
	}
	args := r.args[:0]
	for range n {
		c, err := r.br.ReadByte()
		if err != nil {
			return nil, gateway.NoEOF(err)
		}
		if c != '$' {
			return nil, ProtocolError("expected '$', got '" + printable(c) + "'")
		}
		l, err := r.number('$')
		if err != nil {
			return nil, err
		}
		if l < 0 || l > r.maxBulk {
			return nil, ProtocolError("invalid bulk length")
		}
		b, err := r.bulk(l)
		if err != nil {
			return nil, err
		}
		args = append(args, b)
	}
	if cap(args) <= 64 { // a long command's is not kept
		r.args = args[:0]
	}
	return args, nil
}

// command parses b, one command whole as commandLen measured it: a RESP
// array of bulk strings where it lies (array), anything else through the
// reader, which finds in it the error it would find reading the
// connection.
func (r *reader) command(b []byte) ([][]byte, error) {
	if args, ok := r.array(b); ok {
		return args, nil
	}
	r.feed(b)
	return r.next()
}

// array parses b as next parses a RESP array of bulk strings, if b is
// exactly one, well formed, of at least one element: ok is false for
// anything else (an inline command, an empty or malformed one), left to
// next. Why: the loop has the command whole already, and reading it
// through the reader copied it into the reader's buffer before carving
// its arguments out of that, with a call into the buffered reader per
// line and per argument: a sixth of a pipelined GET's CPU.
func (r *reader) array(b []byte) (args [][]byte, ok bool) {
	if len(b) == 0 || b[0] != '*' {
		return nil, false
	}
	at := lineEnd(b, 1)
	if at <= 0 {
		return nil, false
	}
	n, ok := parseNumber(b[1:at])
	if !ok || n <= 0 || n > maxArgs {
		return nil, false
	}
	args = r.args[:0]
	for range n {
		if at >= len(b) || b[at] != '$' {
			return nil, false
		}
		end := lineEnd(b, at+1)
		if end <= 0 {
			return nil, false
		}
		l, ok := parseNumber(b[at+1 : end])
		if !ok || l < 0 || l > r.maxBulk || l > len(b)-end-2 {
			return nil, false
		}
		at = end + l + 2
		if b[at-2] != '\r' || b[at-1] != '\n' {
			return nil, false
		}
		arg := r.room(l)
		copy(arg, b[end:end+l])
		args = append(args, arg)
	}
	if at != len(b) {
		return nil, false
	}
	if cap(args) <= 64 { // a long command's is not kept
		r.args = args[:0]
	}
	return args, true
}

// room returns l bytes for an argument: carved out of the slab (see
// reader) up to maxCarved, else a buffer of its own.
func (r *reader) room(l int) []byte {
	if l > maxCarved {
		return make([]byte, l)
	}
	if len(r.slab)+l > cap(r.slab) {
		r.slab = make([]byte, 0, slabSize)
	}
	at := len(r.slab)
	r.slab = r.slab[:at+l]
	return r.slab[at : at+l : at+l]
}

// bulk reads l bytes and their CRLF.
func (r *reader) bulk(l int) ([]byte, error) {
	var b []byte
	if l <= maxCarved {
		b = r.room(l)
		if _, err := io.ReadFull(r.br, b); err != nil {
			return nil, gateway.NoEOF(err)
		}
	} else {
		var err error
		if b, err = gateway.ReadValue(r.br, l); err != nil {
			return nil, err
		}
	}
	// Peeked, not read into an array: one passed to io.ReadFull escapes,
	// an allocation for every argument.
	crlf, err := r.br.Peek(2)
	if err != nil {
		return nil, gateway.NoEOF(err)
	}
	if crlf[0] != '\r' || crlf[1] != '\n' {
		return nil, ProtocolError("bulk string not ended by CRLF")
	}
	r.br.Discard(2)
	return b, nil
}

// number reads a decimal up to CRLF (what follows '*' or '$'). The
// common case, a short number whole in the buffer, is parsed where it
// lies: two of these per argument, copying each line cost a pipelined
// GET a twelfth of its CPU.
func (r *reader) number(kind byte) (int, error) {
	line, err := r.br.ReadSlice('\n')
	if err == bufio.ErrBufferFull {
		return 0, r.badNumber(kind)
	}
	if err != nil {
		return 0, gateway.NoEOF(err)
	}
	n, ok := parseNumber(line)
	if !ok {
		return 0, r.badNumber(kind)
	}
	return n, nil
}

// parseNumber parses a number line (what follows '*' or '$', its LF
// included or not): a negative count of any size is an empty command,
// and one too big for anything MaxInt, which the caller refuses.
func parseNumber(line []byte) (int, bool) {
	if len(line) > 34 {
		return 0, false
	}
	if len(line) > 0 && line[len(line)-1] == '\n' {
		line = line[:len(line)-1]
	}
	if len(line) > 0 && line[len(line)-1] == '\r' {
		line = line[:len(line)-1]
	}
	neg := len(line) > 0 && line[0] == '-'
	digits := line
	if neg {
		digits = line[1:]
	}
	if len(digits) == 0 {
		return 0, false
	}
	n := 0
	for _, c := range digits {
		if c < '0' || c > '9' {
			return 0, false
		}
		if n > (math.MaxInt-9)/10 {
			n = math.MaxInt
			continue
		}
		n = n*10 + int(c-'0')
	}
	if neg {
		return -n, true
	}
	return n, true
}

// badNumber is number's error, in Redis's words.
func (r *reader) badNumber(kind byte) error {
	if kind == '*' {
		return ProtocolError("invalid multibulk length")
	}
	return ProtocolError("invalid bulk length")
}

// line reads up to CRLF, at most max bytes.
func (r *reader) line(max int) ([]byte, error) {
	var out []byte
	for {
		frag, err := r.br.ReadSlice('\n')
		if len(out)+len(frag) > max+2 {
			return nil, ProtocolError("too big inline request")
		}
		out = append(out, frag...)
		if err == nil {
			break
		}
		if err != bufio.ErrBufferFull {
			return nil, gateway.NoEOF(err)
		}
	}
	out = out[:len(out)-1]
	if len(out) == 0 || out[len(out)-1] != '\r' {
		// Redis takes a bare LF after an inline command; not in RESP.
		return out, nil
	}
	return out[:len(out)-1], nil
}

// inline reads a command typed as words: separated by blanks, with "..."
// (C escapes) and '...' quoting as redis-cli and Redis take them.
func (r *reader) inline() ([][]byte, error) {
	line, err := r.line(maxInline)
	if err != nil {
		return nil, err
	}
	return splitArgs(line)
}

// splitArgs splits an inline command line.
func splitArgs(line []byte) ([][]byte, error) {
	var args [][]byte
	i := 0
	for {
		for i < len(line) && isBlank(line[i]) {
			i++
		}
		if i == len(line) {
			return args, nil
		}
		if len(args) == maxArgs {
			return nil, ProtocolError("invalid multibulk length")
		}
		var arg []byte
		switch line[i] {
		case '"':
			i++
			for {
				if i == len(line) {
					return nil, ProtocolError("unbalanced quotes in request")
				}
				c := line[i]
				if c == '"' {
					i++
					break
				}
				if c == '\\' && i+1 < len(line) {
					i++
					switch e := line[i]; e {
					case 'n':
						c = '\n'
					case 'r':
						c = '\r'
					case 't':
						c = '\t'
					case 'b':
						c = '\b'
					case 'a':
						c = '\a'
					case 'x':
						if i+2 < len(line) {
							if v, err := strconv.ParseUint(string(line[i+1:i+3]), 16, 8); err == nil {
								c = byte(v)
								i += 2
								break
							}
						}
						c = 'x'
					default:
						c = e
					}
				}
				arg = append(arg, c)
				i++
			}
		case '\'':
			i++
			for {
				if i == len(line) {
					return nil, ProtocolError("unbalanced quotes in request")
				}
				c := line[i]
				if c == '\'' {
					i++
					break
				}
				if c == '\\' && i+1 < len(line) && line[i+1] == '\'' {
					i++
					c = '\''
				}
				arg = append(arg, c)
				i++
			}
		default:
			j := i
			for j < len(line) && !isBlank(line[j]) {
				j++
			}
			arg = bytes.Clone(line[i:j])
			i = j
			args = append(args, arg)
			continue
		}
		// A closing quote must be followed by a blank or the end.
		if i < len(line) && !isBlank(line[i]) {
			return nil, ProtocolError("unbalanced quotes in request")
		}
		if arg == nil {
			arg = []byte{}
		}
		args = append(args, arg)
	}
}

func isBlank(c byte) bool { return c == ' ' || c == '\t' || c == '\r' || c == '\n' }

func printable(c byte) string {
	if c < ' ' || c > '~' {
		return "\\x" + strconv.FormatUint(uint64(c), 16)
	}
	return string(c)
}
