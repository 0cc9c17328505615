package resp

import (
	"errors"
	"strconv"
)

// Kind is the type of a reply value.
type Kind byte

const (
	SimpleString Kind = '+'
	ErrorReply   Kind = '-'
	Integer      Kind = ':'
	BulkString   Kind = '$'
	Array        Kind = '*'
)

// Value is one parsed reply.
type Value struct {
	Kind  Kind
	Str   []byte  // simple string, error text (after "-ERR "), or bulk (nil for $-1)
	Null  bool    // $-1 or *-1
	Int   int64   // integer
	Elems []Value // array
}

// Err returns the reply as an Error if it is one.
func (v Value) Err() error {
	if v.Kind == ErrorReply {
		return Error(v.Str)
	}
	return nil
}

// ErrBadReply is returned for a reply that is not one complete RESP value.
var ErrBadReply = errors.New("resp: malformed reply")

// maxDepth bounds nested arrays in a reply.
const maxDepth = 8

// ParseReply reads one complete reply; trailing bytes are an error.
func ParseReply(b []byte) (Value, error) {
	v, n, err := parseValue(b, 0)
	if err != nil {
		return Value{}, err
	}
	if n != len(b) {
		return Value{}, ErrBadReply
	}
	return v, nil
}

func parseValue(b []byte, depth int) (Value, int, error) {
	if len(b) < 3 || depth > maxDepth {
		return Value{}, 0, ErrBadReply
	}
	line, rest, ok := cutLine(b[1:])
	if !ok {
		return Value{}, 0, ErrBadReply
	}
	used := len(b) - len(rest)
	switch k := Kind(b[0]); k {
	case SimpleString:
		return Value{Kind: k, Str: line}, used, nil
	case ErrorReply:
		text := line
		if len(text) >= 4 && string(text[:4]) == "ERR " {
			text = text[4:]
		}
		return Value{Kind: k, Str: text}, used, nil
	case Integer:
		n, err := strconv.ParseInt(string(line), 10, 64)
		if err != nil {
			return Value{}, 0, ErrBadReply
		}
		return Value{Kind: k, Int: n}, used, nil
	case BulkString:
		n, err := strconv.Atoi(string(line))
		if err != nil || n < -1 {
			return Value{}, 0, ErrBadReply
		}
		if n == -1 {
			return Value{Kind: k, Null: true}, used, nil
		}
		if n > len(rest)-2 || rest[n] != '\r' || rest[n+1] != '\n' {
			return Value{}, 0, ErrBadReply
		}
		return Value{Kind: k, Str: rest[:n:n]}, used + n + 2, nil
	case Array:
		n, err := strconv.Atoi(string(line))
		if err != nil || n < -1 || n > len(rest) {
			return Value{}, 0, ErrBadReply
		}
		if n == -1 {
			return Value{Kind: k, Null: true}, used, nil
		}
		v := Value{Kind: k, Elems: make([]Value, 0, n)}
		for i := 0; i < n; i++ {
			e, m, err := parseValue(b[used:], depth+1)
			if err != nil {
				return Value{}, 0, err
			}
			v.Elems = append(v.Elems, e)
			used += m
		}
		return v, used, nil
	}
	return Value{}, 0, ErrBadReply
}

func cutLine(b []byte) (line, rest []byte, ok bool) {
	for i := 0; i+1 < len(b); i++ {
		if b[i] == '\r' && b[i+1] == '\n' {
			return b[:i], b[i+2:], true
		}
	}
	return nil, nil, false
}
