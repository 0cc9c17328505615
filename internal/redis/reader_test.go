package redis

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"slices"
	"testing"
)

func read(in string, maxBulk int) ([][][]byte, error) {
	r := &reader{br: bufio.NewReaderSize(bytes.NewReader([]byte(in)), 16), maxBulk: maxBulk}
	var cmds [][][]byte
	for {
		args, err := r.next()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return cmds, nil
			}
			return cmds, err
		}
		cmds = append(cmds, args)
	}
}

func TestReaderTakesWhatRedisTakes(t *testing.T) {
	for _, c := range []struct {
		in   string
		want [][]string
	}{
		{"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n", [][]string{{"GET", "k"}}},
		{"*1\r\n$0\r\n\r\n", [][]string{{""}}},
		{"*0\r\n*-1\r\n", [][]string{nil, nil}},
		{"PING\r\nPING\n", [][]string{{"PING"}, {"PING"}}},
		{"  set  k   'a b'  \"c\\x41\\n\"\r\n", [][]string{{"set", "k", "a b", "cA\n"}}},
		{"\r\n", [][]string{nil}},
		{"*2\r\n$4\r\nECHO\r\n$20\r\n" + "01234567890123456789" + "\r\n", [][]string{{"ECHO", "01234567890123456789"}}},
	} {
		cmds, err := read(c.in, 1<<20)
		if err != nil {
			t.Fatalf("%q: %v", c.in, err)
		}
		var got [][]string
		for _, args := range cmds {
			var s []string
			for _, a := range args {
				s = append(s, string(a))
			}
			got = append(got, s)
		}
		if !slices.EqualFunc(got, c.want, slices.Equal) {
			t.Fatalf("%q: %q, want %q", c.in, got, c.want)
		}
	}
}

func TestReaderRefusesWhatIsNotRESP(t *testing.T) {
	for _, in := range []string{
		"*1\r\n$-1\r\n",                    // a null bulk in a command
		"*x\r\n",                           // not a number
		"*+1\r\n$1\r\na\r\n",               // a sign
		"*1\r\n:1\r\n",                     // not a bulk
		"*1\r\n$1\r\nab\r\n",               // longer than it said
		"*1\r\n$11\r\nhello\r\n",           // too long for the limit of 10
		"*65537\r\n",                       // too many arguments
		"set 'a\r\n",                       // unbalanced
		"set \"a\"b\r\n",                   // a quote not followed by a blank
		"*1\r\n$999999999999999999999\r\n", // overflow
	} {
		_, err := read(in, 10)
		var pe ProtocolError
		if !errors.As(err, &pe) {
			t.Fatalf("%q: %v, want a protocol error", in, err)
		}
	}
	if _, err := read("*2\r\n$3\r\nGET\r\n", 10); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("a command cut short: %v", err)
	}
}

// FuzzReader: any input reads as commands or ends in an error, without a
// panic, and what it reads never holds more than the input.
func FuzzReader(f *testing.F) {
	for _, s := range []string{
		"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n", "*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n",
		"PING\r\n", "set k 'a b' \"c\\x41\"\r\n", "*0\r\n", "*1\r\n$-1\r\n", "*99999999\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		cmds, _ := read(string(in), 1<<16)
		total := 0
		for _, args := range cmds {
			for _, a := range args {
				total += len(a)
			}
		}
		if total > len(in) {
			t.Fatalf("%d bytes of arguments from %d of input", total, len(in))
		}
	})
}
