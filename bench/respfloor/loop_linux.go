package main

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"syscall"
)

// serveLoop is the durable floor in Redis's shape: one goroutine, locked
// to its thread, waits in epoll for every socket (the listener's too),
// reads what each ready connection sent, appends its commands to the log,
// and once every ready connection is read, writes and fdatasyncs the log
// and writes each connection's replies: no goroutine per connection, no
// hand-off, no Go network poller. What a Go server of that shape costs
// above Redis on this machine is what Go costs, not what mqkv's shape
// does. logs is where each round's commands go (commitLog.append).
func serveLoop(addr string, logs *commitLog) error {
	runtime.LockOSThread()
	lfd, err := listenRaw(addr)
	if err != nil {
		return err
	}
	ep, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return err
	}
	if err := syscall.EpollCtl(ep, syscall.EPOLL_CTL_ADD, lfd, &syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(lfd)}); err != nil {
		return err
	}
	type lconn struct {
		in   []byte
		owed int
	}
	conns := map[int]*lconn{}
	events := make([]syscall.EpollEvent, 256)
	var logBuf, out []byte
	var due []int
	rd := make([]byte, 64<<10)
	closeConn := func(fd int) {
		syscall.EpollCtl(ep, syscall.EPOLL_CTL_DEL, fd, nil)
		syscall.Close(fd)
		delete(conns, fd)
	}
	for {
		n, err := syscall.EpollWait(ep, events, -1)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		for _, ev := range events[:n] {
			fd := int(ev.Fd)
			if fd == lfd {
				for {
					cfd, _, err := syscall.Accept4(lfd, syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC)
					if err != nil {
						break
					}
					syscall.SetsockoptInt(cfd, syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1)
					if syscall.EpollCtl(ep, syscall.EPOLL_CTL_ADD, cfd, &syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(cfd)}) != nil {
						syscall.Close(cfd)
						continue
					}
					conns[cfd] = &lconn{}
				}
				continue
			}
			c := conns[fd]
			if c == nil {
				continue
			}
			// One read for each readiness, as Redis reads: a connection
			// with more left is ready again at the next wait.
			m, err := syscall.Read(fd, rd)
			if m <= 0 {
				if m == 0 || !errors.Is(err, syscall.EAGAIN) {
					closeConn(fd)
				}
				continue
			}
			c.in = append(c.in, rd[:m]...)
			had := c.owed
			for {
				size, err := commandSize(c.in)
				if err != nil {
					closeConn(fd)
					break
				}
				if size == 0 {
					break
				}
				logBuf = append(logBuf, c.in[:size]...)
				c.in = c.in[size:]
				c.owed++
			}
			c.in = append(c.in[:0:0], c.in...) // keep only the partial command
			if had == 0 && c.owed > 0 {
				due = append(due, fd)
			}
		}
		if len(logBuf) == 0 {
			continue
		}
		if err := logs.append(logBuf); err != nil {
			return err
		}
		logBuf = logBuf[:0]
		for _, fd := range due {
			c := conns[fd]
			if c == nil {
				continue
			}
			out = out[:0]
			for range c.owed {
				out = append(out, "+OK\r\n"...)
			}
			c.owed = 0
			if _, err := syscall.Write(fd, out); err != nil {
				closeConn(fd)
			}
		}
		due = due[:0]
	}
}

// commandSize returns the length of the RESP command at the front of b,
// or 0 if b does not hold all of it yet.
func commandSize(b []byte) (int, error) {
	n, at, err := lineNumber(b, 0, '*')
	if at == 0 || err != nil {
		return 0, err
	}
	for range n {
		size, next, err := lineNumber(b, at, '$')
		if next == 0 || err != nil {
			return 0, err
		}
		at = next + size + 2
		if at > len(b) {
			return 0, nil
		}
	}
	return at, nil
}

// lineNumber reads "<kind><number>\r\n" at b[at:], returning the number
// and the offset after the line (0 if the line is not complete).
func lineNumber(b []byte, at int, kind byte) (int, int, error) {
	end := bytes.IndexByte(b[at:], '\n')
	if end < 0 {
		return 0, 0, nil
	}
	n, err := headerNumber(b[at:at+end+1], kind)
	if err != nil {
		return 0, 0, err
	}
	return n, at + end + 1, nil
}

// listenRaw opens a non-blocking listening socket on an IPv4 address.
func listenRaw(addr string) (int, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil || !ap.Addr().Is4() {
		return 0, fmt.Errorf("address %q: want IPv4:PORT", addr)
	}
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1)
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}); err != nil {
		syscall.Close(fd)
		return 0, err
	}
	if err := syscall.Listen(fd, 1024); err != nil {
		syscall.Close(fd)
		return 0, err
	}
	return fd, nil
}
