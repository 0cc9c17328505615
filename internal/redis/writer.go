package redis

import (
	"strconv"
	"strings"

	"github.com/mqkv/mqkv/internal/resp"
)

// writer encodes replies into b in the connection's protocol version:
// RESP2, or RESP3 after HELLO 3 (nulls and maps of their own).
type writer struct {
	b     []byte
	proto int
}

// take returns what was written and starts over.
func (w *writer) take() []byte {
	b := w.b
	w.b = nil
	return b
}

func (w *writer) str(s string) { w.b = append(w.b, s...) }

func (w *writer) line(kind byte, s string) {
	w.b = append(w.b, kind)
	w.b = append(w.b, s...)
	w.b = append(w.b, '\r', '\n')
}

func (w *writer) simple(s string) { w.line('+', s) }

// err writes an error; text starts with its code ("ERR ...", "NOAUTH
// ..."). CR and LF would end the line early, so they become spaces.
func (w *writer) err(text string) {
	w.line('-', strings.NewReplacer("\r", " ", "\n", " ").Replace(text))
}

func (w *writer) integer(n int64) { w.b = resp.AppendInt(w.b, n) }

func (w *writer) bulk(b []byte) { w.b = resp.AppendBulk(w.b, b) }

func (w *writer) bulkString(s string) { w.bulk([]byte(s)) }

func (w *writer) null() {
	if w.proto >= 3 {
		w.str("_\r\n")
		return
	}
	w.str("$-1\r\n")
}

func (w *writer) array(n int) { w.line('*', strconv.Itoa(n)) }

// mapHeader starts a map of n pairs (an array of 2n elements in RESP2).
func (w *writer) mapHeader(n int) {
	if w.proto >= 3 {
		w.line('%', strconv.Itoa(n))
		return
	}
	w.array(2 * n)
}

// value writes a reply of the statestore service as it is (its errors
// with the ERR code, or NOPERM for authorization).
func (w *writer) value(v resp.Value) {
	switch v.Kind {
	case resp.ErrorReply:
		w.storeErr(v)
	case resp.SimpleString:
		w.simple(string(v.Str))
	case resp.Integer:
		w.integer(v.Int)
	case resp.BulkString:
		if v.Null {
			w.null()
			return
		}
		w.bulk(v.Str)
	case resp.Array:
		if v.Null {
			w.null()
			return
		}
		w.array(len(v.Elems))
		for _, e := range v.Elems {
			w.value(e)
		}
	}
}

// storeErr writes an error of the service with Redis's codes where one
// fits.
func (w *writer) storeErr(v resp.Value) {
	switch msg := string(v.Str); msg {
	case string(resp.ErrNotAuthorized):
		w.err("NOPERM this user has no permissions to access one of the keys used as arguments")
	case string(resp.ErrSyntax):
		w.err("ERR syntax error")
	default:
		w.err("ERR " + msg)
	}
}
