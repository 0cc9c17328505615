package redis

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
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
		cmds = append(cmds, slices.Clone(args)) // next reuses the slice
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

// Arguments carved out of shared slabs keep their bytes while later
// commands are read, across slabs, and a large one gets its own.
func TestReaderArgumentsOutliveTheNextCommand(t *testing.T) {
	var in strings.Builder
	var want [][]byte
	for i := range 100 {
		size := 900
		if i%10 == 9 {
			size = 5000 // beyond maxCarved
		}
		v := bytes.Repeat([]byte{byte('a' + i%26)}, size)
		want = append(want, v)
		fmt.Fprintf(&in, "*3\r\n$3\r\nSET\r\n$%d\r\nk%d\r\n$%d\r\n%s\r\n", len(strconv.Itoa(i))+1, i, size, v)
	}
	r := &reader{br: bufio.NewReaderSize(strings.NewReader(in.String()), 4096), maxBulk: 1 << 20}
	var values [][]byte
	for range want {
		args, err := r.next()
		if err != nil {
			t.Fatal(err)
		}
		values = append(values, args[2]) // the bytes, not the slice of arguments
	}
	for i, v := range values {
		if !bytes.Equal(v, want[i]) {
			t.Fatalf("value %d changed once later commands were read: %.20q...", i, v)
		}
		if cap(v) != len(v) {
			t.Fatalf("value %d has room past its end (%d > %d): an append would write over the next", i, cap(v), len(v))
		}
	}
}
