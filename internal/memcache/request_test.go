package memcache

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/mqkv/mqkv/internal/hlc"
)

func readAll(in []byte, maxValue int) ([]*request, []error) {
	br := bufio.NewReaderSize(bytes.NewReader(in), 16)
	var reqs []*request
	var errs []error
	for {
		r, err := readRequest(br, maxValue)
		if err != nil {
			var ce clientError
			if errors.Is(err, errUnknown) || errors.Is(err, errTooLarge) || (errors.As(err, &ce) && !errors.Is(err, errLineTooLong)) {
				errs = append(errs, err)
				continue
			}
			return reqs, append(errs, err)
		}
		reqs = append(reqs, r)
	}
}

func TestRequestsAsMemcachedTakesThem(t *testing.T) {
	reqs, errs := readAll([]byte("get a b\r\nset k 5 100 2 noreply\r\nhi\r\ncas k 0 0 1 77\r\nx\r\nincr n 3\ndelete k 0\r\ntouch k 10 noreply\r\n"), 1<<20)
	if len(errs) != 1 || !errors.Is(errs[0], io.EOF) {
		t.Fatalf("errors %v", errs)
	}
	want := []struct {
		name    string
		keys    int
		noreply bool
	}{{"get", 2, false}, {"set", 1, true}, {"cas", 1, false}, {"incr", 1, false}, {"delete", 1, false}, {"touch", 1, true}}
	if len(reqs) != len(want) {
		t.Fatalf("%d requests, want %d", len(reqs), len(want))
	}
	for i, w := range want {
		if r := reqs[i]; r.name != w.name || len(r.keys) != w.keys || r.noreply != w.noreply {
			t.Fatalf("request %d: %+v, want %+v", i, r, w)
		}
	}
	if r := reqs[1]; r.flags != 5 || r.exptime != 100 || string(r.data) != "hi" {
		t.Fatalf("set: %+v", r)
	}
	if reqs[2].cas != 77 || reqs[3].delta != 3 {
		t.Fatalf("cas %d, incr %d", reqs[2].cas, reqs[3].delta)
	}
}

func TestBadRequestsAreAnsweredAndSkipped(t *testing.T) {
	// A bad line, a block too large (skipped whole), a block of the wrong
	// length (skipped to its line's end), then a good command.
	in := "set k x 0 1\r\nset k 0 0 20\r\n" + string(bytes.Repeat([]byte("y"), 20)) + "\r\nset k 0 0 2\r\nhello\r\nget k\r\n"
	reqs, errs := readAll([]byte(in), 10)
	if len(reqs) != 1 || reqs[0].name != "get" {
		t.Fatalf("requests %+v", reqs)
	}
	if len(errs) != 4 || !errors.Is(errs[1], errTooLarge) || errs[2].Error() != "CLIENT_ERROR bad data chunk" {
		t.Fatalf("errors %v", errs)
	}
	long := append([]byte("get "), bytes.Repeat([]byte("k"), maxLine)...)
	if _, errs := readAll(append(long, '\r', '\n'), 10); !errors.Is(errs[len(errs)-1], errLineTooLong) {
		t.Fatalf("a line too long: %v", errs)
	}
}

func TestFlagsRoundTrip(t *testing.T) {
	for _, c := range []struct {
		flags uint32
		data  string
	}{{0, "plain"}, {42, "with flags"}, {1 << 31, ""}, {0, ""}} {
		stored := encodeValue(c.flags, []byte(c.data))
		if c.flags == 0 && string(stored) != c.data {
			t.Fatalf("flags 0 stored as %q", stored)
		}
		f, d := decodeValue(stored)
		if f != c.flags || string(d) != c.data {
			t.Fatalf("%d %q came back as %d %q", c.flags, c.data, f, d)
		}
	}
}

func TestCasUniqueFollowsTheVersion(t *testing.T) {
	a := hlc.Timestamp{Wall: 1, Counter: 2, Node: "n1"}
	b := hlc.Timestamp{Wall: 1, Counter: 3, Node: "n1"}
	if casUnique(a) != casUnique(a) || casUnique(a) == casUnique(b) {
		t.Fatal("cas uniques do not follow versions")
	}
}

// FuzzRequest: any input reads as requests and errors, without a panic,
// and no request holds more value bytes than the input had.
func FuzzRequest(f *testing.F) {
	for _, s := range []string{
		"get a b\r\n", "set k 0 0 2\r\nhi\r\n", "cas k 1 2 1 99 noreply\r\nx\r\n", "incr n 18446744073709551615\r\n",
		"set k 0 0 99999999\r\n", "delete k 0\r\n", "touch k -1\r\n", "stats items\r\n", "\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		reqs, _ := readAll(in, 1<<16)
		total := 0
		for _, r := range reqs {
			total += len(r.data)
		}
		if total > len(in) {
			t.Fatalf("%d value bytes from %d of input", total, len(in))
		}
	})
}
