package memcache

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"strconv"

	"github.com/mqkv/mqkv/internal/gateway"
)

// Limits of the text protocol, as memcached has them.
const (
	maxKey  = 250     // bytes in a key
	maxLine = 8 << 10 // a command line (a get of many keys included)
)

// request is one parsed command.
type request struct {
	name    string   // lower case, as memcached takes them
	keys    [][]byte // get/gets: all; others: the one
	flags   uint32
	exptime int64
	cas     uint64
	delta   uint64 // incr/decr
	data    []byte // storage commands
	noreply bool
}

// clientError is input memcached answers with "CLIENT_ERROR <text>"; the
// connection goes on (the data block, if any, was read past).
type clientError string

func (e clientError) Error() string { return "CLIENT_ERROR " + string(e) }

// errUnknown is a command memcached does not have: it answers "ERROR".
var errUnknown = errors.New("ERROR")

// errTooLarge is a value above the limit: its data block was read past.
var errTooLarge = errors.New("SERVER_ERROR object too large for cache")

// errLineTooLong ends the connection, as memcached does for a line it
// cannot buffer.
var errLineTooLong = clientError("line too long")

// readRequest reads one command, with its data block for a storage
// command. maxValue bounds a value. A line too long, or input ending
// inside a command, ends the connection (the error is returned with what
// to say); a malformed command is a clientError and the connection goes on.
func readRequest(br *bufio.Reader, maxValue int) (*request, error) {
	line, err := readLine(br)
	if err != nil {
		return nil, err
	}
	fields := bytes.Fields(line)
	if len(fields) == 0 {
		return nil, errUnknown
	}
	r := &request{name: string(bytes.ToLower(fields[0]))}
	args := fields[1:]
	switch r.name {
	case "get", "gets":
		if len(args) == 0 {
			return nil, errUnknown
		}
		for _, k := range args {
			if !validKey(k) {
				return nil, clientError("bad command line format")
			}
		}
		r.keys = args
	case "set", "add", "replace", "append", "prepend", "cas":
		want := 4
		if r.name == "cas" {
			want = 5
		}
		if len(args) == want+1 && string(args[want]) == "noreply" {
			r.noreply = true
			args = args[:want]
		}
		if len(args) != want || !validKey(args[0]) {
			return nil, clientError("bad command line format")
		}
		flags, err1 := strconv.ParseUint(string(args[1]), 10, 32)
		exptime, err2 := strconv.ParseInt(string(args[2]), 10, 64)
		n, err3 := strconv.ParseInt(string(args[3]), 10, 32)
		if err1 != nil || err2 != nil || err3 != nil || n < 0 {
			return nil, clientError("bad command line format")
		}
		if r.name == "cas" {
			if r.cas, err = strconv.ParseUint(string(args[4]), 10, 64); err != nil {
				return nil, clientError("bad command line format")
			}
		}
		r.keys, r.flags, r.exptime = args[:1], uint32(flags), exptime
		if int(n) > maxValue {
			// Read past the block, as memcached does, to stay in step.
			if _, err := br.Discard(int(n) + 2); err != nil {
				return nil, gateway.NoEOF(err)
			}
			return nil, errTooLarge
		}
		data, err := gateway.ReadValue(br, int(n))
		if err != nil {
			return nil, err
		}
		var crlf [2]byte
		if _, err := io.ReadFull(br, crlf[:]); err != nil {
			return nil, gateway.NoEOF(err)
		}
		if crlf != [2]byte{'\r', '\n'} {
			// A length that does not match the block: the rest of the
			// line is the block's, not a command.
			if crlf[1] != '\n' {
				if _, err := readLine(br); err != nil && !errors.Is(err, errLineTooLong) {
					return nil, err
				}
			}
			return nil, clientError("bad data chunk")
		}
		r.data = data
	case "delete":
		if len(args) == 2 && string(args[1]) == "noreply" {
			r.noreply, args = true, args[:1]
		}
		if len(args) == 2 && string(args[1]) == "0" { // an old client's time argument
			args = args[:1]
		}
		if len(args) != 1 || !validKey(args[0]) {
			return nil, clientError("bad command line format.  Usage: delete <key> [noreply]")
		}
		r.keys = args
	case "incr", "decr":
		if len(args) == 3 && string(args[2]) == "noreply" {
			r.noreply, args = true, args[:2]
		}
		if len(args) != 2 || !validKey(args[0]) {
			return nil, clientError("bad command line format")
		}
		if r.delta, err = strconv.ParseUint(string(args[1]), 10, 64); err != nil {
			return nil, clientError("invalid numeric delta argument")
		}
		r.keys = args[:1]
	case "touch":
		if len(args) == 3 && string(args[2]) == "noreply" {
			r.noreply, args = true, args[:2]
		}
		if len(args) != 2 || !validKey(args[0]) {
			return nil, clientError("bad command line format")
		}
		if r.exptime, err = strconv.ParseInt(string(args[1]), 10, 64); err != nil {
			return nil, clientError("invalid exptime argument")
		}
		r.keys = args[:1]
	case "version", "stats", "quit", "verbosity", "flush_all":
		r.keys = args // stats' and verbosity's arguments
	default:
		return nil, errUnknown
	}
	return r, nil
}

// readLine reads a line ended by "\r\n" (or "\n", as memcached takes it).
func readLine(br *bufio.Reader) ([]byte, error) {
	var out []byte
	for {
		frag, err := br.ReadSlice('\n')
		if len(out)+len(frag) > maxLine {
			return nil, errLineTooLong
		}
		out = append(out, frag...)
		if err == nil {
			break
		}
		if err != bufio.ErrBufferFull {
			if len(out) > 0 {
				return nil, io.ErrUnexpectedEOF
			}
			return nil, err
		}
	}
	out = out[:len(out)-1]
	if len(out) > 0 && out[len(out)-1] == '\r' {
		out = out[:len(out)-1]
	}
	return out, nil
}

// validKey: 1 to 250 bytes, no control characters or spaces.
func validKey(k []byte) bool {
	if len(k) == 0 || len(k) > maxKey {
		return false
	}
	for _, c := range k {
		if c <= ' ' || c == 0x7f {
			return false
		}
	}
	return true
}
