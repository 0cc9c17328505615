package redis_test

import (
	"bufio"
	"io"
	"log/slog"
	"net"
	"strconv"
	"testing"

	"github.com/mqkv/mqkv/internal/server"
)

// BenchmarkSET is one client's SETs through a node's RESP endpoint (in
// memory: the log is not synced), one at a time: what a SET costs the
// server, allocations included (the process's, so the server's).
func BenchmarkSET(b *testing.B) { benchmarkSET(b, 1, 1) }

// BenchmarkSETPipelined is 8 clients' SETs, 16 at a time each (as
// redis-benchmark -P 16): a write's allocations once the log's entries
// and the connection's writes carry many. b.N counts rounds of 128.
func BenchmarkSETPipelined(b *testing.B) { benchmarkSET(b, 8, 16) }

func benchmarkSET(b *testing.B, clients, pipeline int) {
	s, err := server.Start(server.Config{Listen: "127.0.0.1:0", RESPListen: "127.0.0.1:0", InMemory: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	conns := make([]net.Conn, clients)
	readers := make([]*bufio.Reader, clients)
	for i := range conns {
		if conns[i], err = net.Dial("tcp", s.RESPAddr()); err != nil {
			b.Fatal(err)
		}
		defer conns[i].Close()
		readers[i] = bufio.NewReader(conns[i])
	}
	value := make([]byte, 256)
	var cmd []byte
	n := 0
	b.ReportAllocs()
	for b.Loop() {
		for _, c := range conns {
			cmd = cmd[:0]
			for range pipeline {
				key := "key:" + strconv.Itoa(n%10000)
				n++
				cmd = append(cmd, "*3\r\n$3\r\nSET\r\n$"...)
				cmd = strconv.AppendInt(cmd, int64(len(key)), 10)
				cmd = append(cmd, "\r\n"...)
				cmd = append(cmd, key...)
				cmd = append(cmd, "\r\n$256\r\n"...)
				cmd = append(cmd, value...)
				cmd = append(cmd, "\r\n"...)
			}
			if _, err := c.Write(cmd); err != nil {
				b.Fatal(err)
			}
		}
		for _, br := range readers {
			for range pipeline {
				if line, err := br.ReadSlice('\n'); err != nil || string(line) != "+OK\r\n" {
					b.Fatalf("reply %q, %v", line, err)
				}
			}
		}
	}
}
