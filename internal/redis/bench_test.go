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
func BenchmarkSET(b *testing.B) {
	s, err := server.Start(server.Config{Listen: "127.0.0.1:0", RESPListen: "127.0.0.1:0", InMemory: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	c, err := net.Dial("tcp", s.RESPAddr())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	value := make([]byte, 256)
	var cmd []byte
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		key := "key:" + strconv.Itoa(i%10000)
		cmd = append(cmd[:0], "*3\r\n$3\r\nSET\r\n$"...)
		cmd = strconv.AppendInt(cmd, int64(len(key)), 10)
		cmd = append(cmd, "\r\n"...)
		cmd = append(cmd, key...)
		cmd = append(cmd, "\r\n$256\r\n"...)
		cmd = append(cmd, value...)
		cmd = append(cmd, "\r\n"...)
		if _, err := c.Write(cmd); err != nil {
			b.Fatal(err)
		}
		line, err := br.ReadString('\n')
		if err != nil || line != "+OK\r\n" {
			b.Fatalf("reply %q, %v", line, err)
		}
	}
}
