// Command respfloor is the floor under mqkv's RESP endpoint on this
// machine: a Go server of the same shape (a goroutine per connection,
// reading through a bufio.Reader, one write per batch of replies, the
// socket read and written with internal/sockio's raw calls) that
// parses each RESP command and answers +OK without doing anything: no
// store, no log, no disk. bench/resp.sh runs it beside mqkv and Redis, so
// that what a SET costs above the network and Go's scheduler shows.
//
//	respfloor ADDRESS
package main

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"

	"github.com/mqkv/mqkv/internal/sockio"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: respfloor ADDRESS")
		os.Exit(2)
	}
	tcp, err := net.Listen("tcp", os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ln := sockio.Listener(tcp)
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		go serve(c)
	}
}

// serve answers every command of c with +OK (PING's and SET's reply; the
// load generator asks CONFIG GET first and takes an error-free answer).
func serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReaderSize(c, 16<<10)
	var out []byte
	for {
		if err := skipCommand(br); err != nil {
			return
		}
		out = append(out, "+OK\r\n"...)
		if br.Buffered() == 0 {
			if _, err := c.Write(out); err != nil {
				return
			}
			out = out[:0]
		}
	}
}

// skipCommand reads one RESP array of bulk strings.
func skipCommand(br *bufio.Reader) error {
	n, err := header(br, '*')
	if err != nil {
		return err
	}
	for range n {
		size, err := header(br, '$')
		if err != nil {
			return err
		}
		if _, err := br.Discard(size + 2); err != nil {
			return err
		}
	}
	return nil
}

func header(br *bufio.Reader, kind byte) (int, error) {
	line, err := br.ReadSlice('\n')
	if err != nil {
		return 0, err
	}
	if len(line) < 4 || line[0] != kind {
		return 0, errors.New("not a RESP command")
	}
	n, err := strconv.Atoi(string(line[1 : len(line)-2]))
	if err != nil || n < 0 || n > 64<<20 {
		return 0, errors.New("bad length")
	}
	return n, nil
}
