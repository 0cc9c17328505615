package gateway

import (
	"errors"
	"net"
	"sync"
)

// Listener accepts a gateway's connections, serves each on its own
// goroutine, and ends them all on Close.
type Listener struct {
	ln    net.Listener
	serve func(net.Conn)

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// Serve serves every connection ln accepts with serve (which need not
// close it), until Close.
func Serve(ln net.Listener, serve func(net.Conn)) *Listener {
	l := &Listener{ln: ln, serve: serve, conns: map[net.Conn]struct{}{}}
	l.wg.Add(1)
	go l.accept()
	return l
}

// Addr is the listener's address.
func (l *Listener) Addr() string { return l.ln.Addr().String() }

// Accept waits for ln's next connection, past timeouts: an error it
// returns ends the listening.
func Accept(ln net.Listener) (net.Conn, error) {
	for {
		c, err := ln.Accept()
		var ne net.Error
		if err != nil && errors.As(err, &ne) && ne.Timeout() {
			continue
		}
		return c, err
	}
}

func (l *Listener) accept() {
	defer l.wg.Done()
	for {
		c, err := Accept(l.ln)
		if err != nil {
			return
		}
		l.mu.Lock()
		if l.closed {
			l.mu.Unlock()
			c.Close()
			return
		}
		l.conns[c] = struct{}{}
		l.wg.Add(1)
		l.mu.Unlock()
		go func() {
			defer l.wg.Done()
			l.serve(c)
			l.mu.Lock()
			delete(l.conns, c)
			l.mu.Unlock()
			c.Close()
		}()
	}
}

// Close stops listening, closes every connection and waits for their
// goroutines.
func (l *Listener) Close() error {
	l.mu.Lock()
	l.closed = true
	for c := range l.conns {
		c.Close()
	}
	l.mu.Unlock()
	err := l.ln.Close()
	l.wg.Wait()
	return err
}
