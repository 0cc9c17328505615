// Package resp reads state store requests (RESP arrays of bulk strings) and
// writes the replies and notifications in the exact bytes the AIO clients
// match on. It holds the protocol's error texts, so they live in one place.
package resp

import (
	"errors"
	"slices"
	"strconv"
)

// Error is a state store error: its text goes on the wire after "-ERR ".
type Error string

func (e Error) Error() string { return string(e) }

// The errors the AIO SDKs recognise, byte for byte (spec section 3).
const (
	ErrTimestampSkew            Error = "the request timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
	ErrMissingFencingToken      Error = "a fencing token is required for this request"
	ErrFencingTokenSkew         Error = "the request fencing token timestamp is too far in the future; ensure that the client and broker system clocks are synchronized"
	ErrFencingTokenLowerVersion Error = "the request fencing token is a lower version than the fencing token protecting the resource"
	ErrQuotaExceeded            Error = "the quota has been exceeded"
	ErrSyntax                   Error = "syntax error"
	ErrNotAuthorized            Error = "not authorized"
	ErrUnknownCommand           Error = "unknown command"
	ErrWrongNumberOfArguments   Error = "wrong number of arguments"
	ErrTimestampMissing         Error = "missing timestamp"
	ErrTimestampMalformed       Error = "malformed timestamp"
	ErrKeyLengthZero            Error = "the key length is zero"
	// Redis's own, for the arithmetic extensions (INCRBY, DECRBY).
	ErrNotInteger Error = "value is not an integer or out of range"
	ErrOverflow   Error = "increment or decrement would overflow"
	// An arithmetic write in a cluster that a member of an earlier
	// release keeps below the protocol that has them (cluster protocol
	// 5): the memcached endpoint counts the old way then.
	ErrArithmeticProtocol Error = "INCRBY and DECRBY need every member of the cluster on a release that has them (cluster protocol 5): upgrade the others"
	// The same for the value ops (APPEND, PREPEND, PEXPIRE, PERSIST) and
	// SET ... XX (cluster protocol 6): the memcached endpoint reads and
	// writes on condition then, as before them.
	ErrValueOpsProtocol Error = "APPEND, PREPEND, PEXPIRE, PERSIST and SET XX need every member of the cluster on a release that has them (cluster protocol 6): upgrade the others"
)

// MaxArgs bounds the number of elements of a request array. No command has
// more than a handful; the bound keeps "*2147483647" from reserving memory.
const MaxArgs = 64

// ParseRequest splits a request payload into its arguments. The arguments
// alias payload (no copies). Anything but one complete array of bulk strings,
// with nothing after it, is a syntax error.
func ParseRequest(payload []byte) ([][]byte, error) {
	if len(payload) == 0 || payload[0] != '*' {
		return nil, ErrSyntax
	}
	n, pos, err := readLength(payload, 1)
	if err != nil || n < 1 || n > MaxArgs {
		return nil, ErrSyntax
	}
	args := make([][]byte, 0, n)
	for i := 0; i < n; i++ {
		if pos >= len(payload) || payload[pos] != '$' {
			return nil, ErrSyntax
		}
		var l int
		l, pos, err = readLength(payload, pos+1)
		if err != nil || l < 0 || l > len(payload)-pos-2 {
			return nil, ErrSyntax
		}
		end := pos + l
		if payload[end] != '\r' || payload[end+1] != '\n' {
			return nil, ErrSyntax
		}
		args = append(args, payload[pos:end:end])
		pos = end + 2
	}
	if pos != len(payload) {
		return nil, ErrSyntax
	}
	return args, nil
}

var errLength = errors.New("resp: bad length")

// readLength reads a non-negative decimal terminated by CRLF, starting at pos,
// and returns it with the position after the CRLF.
func readLength(b []byte, pos int) (int, int, error) {
	start := pos
	v := 0
	for pos < len(b) && b[pos] >= '0' && b[pos] <= '9' {
		if pos-start >= 10 { // more digits than any payload can back
			return 0, 0, errLength
		}
		v = v*10 + int(b[pos]-'0')
		pos++
	}
	if pos == start || pos+1 >= len(b) || b[pos] != '\r' || b[pos+1] != '\n' {
		return 0, 0, errLength
	}
	if b[start] == '0' && pos-start > 1 { // no client pads lengths
		return 0, 0, errLength
	}
	return v, pos + 2, nil
}

// Canonical fixed replies.
var (
	OK       = []byte("+OK\r\n")
	MinusOne = []byte(":-1\r\n") // SET condition not met; VDEL value mismatch
	Nil      = []byte("$-1\r\n") // GET of a missing key
	Zero     = []byte(":0\r\n")
	One      = []byte(":1\r\n")
	Pong     = []byte("+PONG\r\n")
)

// AppendInt appends a RESP integer.
func AppendInt(b []byte, n int64) []byte {
	b = append(b, ':')
	b = strconv.AppendInt(b, n, 10)
	return append(b, '\r', '\n')
}

// AppendBulk appends a RESP bulk string.
func AppendBulk(b, s []byte) []byte {
	b = slices.Grow(b, len(s)+24) // one allocation for a value of any size
	b = append(b, '$')
	b = strconv.AppendInt(b, int64(len(s)), 10)
	b = append(b, '\r', '\n')
	b = append(b, s...)
	return append(b, '\r', '\n')
}

// AppendArrayHeader appends the header of a RESP array of n elements.
func AppendArrayHeader(b []byte, n int) []byte {
	b = append(b, '*')
	b = strconv.AppendInt(b, int64(n), 10)
	return append(b, '\r', '\n')
}

// AppendBulks appends a RESP array of bulk strings.
func AppendBulks(b []byte, elems ...[]byte) []byte {
	b = AppendArrayHeader(b, len(elems))
	for _, e := range elems {
		b = AppendBulk(b, e)
	}
	return b
}

// AppendError appends "-ERR <text>\r\n". CR and LF in text would end the
// line early for every client, so they are replaced by spaces.
func AppendError(b []byte, text string) []byte {
	b = append(b, "-ERR "...)
	for i := 0; i < len(text); i++ {
		c := text[i]
		if c == '\r' || c == '\n' {
			c = ' '
		}
		b = append(b, c)
	}
	return append(b, '\r', '\n')
}

// Notification payloads (spec section 5.1).
var (
	notifyWord = []byte("NOTIFY")
	setWord    = []byte("SET")
	valueWord  = []byte("VALUE")
	deleteWord = []byte("DELETE")
)

// AppendNotifySet appends "NOTIFY SET VALUE <value>".
func AppendNotifySet(b, value []byte) []byte {
	return AppendBulks(b, notifyWord, setWord, valueWord, value)
}

// AppendNotifyDelete appends "NOTIFY DELETE".
func AppendNotifyDelete(b []byte) []byte {
	return AppendBulks(b, notifyWord, deleteWord)
}
