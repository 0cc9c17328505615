package server

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Process is an mqkv server running as a child process, for tools and tests
// that need a real, separate server (benchmarks, crash tests).
type Process struct {
	cmd                  *exec.Cmd
	addr, admin, cluster string
	done                 chan struct{}
}

// Spawn runs `binary serve --listen 127.0.0.1:0 --log-format json extra...`
// and waits until it reports the address it serves MQTT on.
func Spawn(binary string, extra ...string) (*Process, error) {
	return spawn(binary, append([]string{"serve", "--listen", "127.0.0.1:0", "--log-format", "json"}, extra...)) // a later --listen wins
}

// SpawnAttached starts `binary attach` with extra arguments (--broker
// among them): a server with no MQTT listener of its own (Addr is "").
func SpawnAttached(binary string, extra ...string) (*Process, error) {
	return spawn(binary, append([]string{"attach", "--log-format", "json"}, extra...))
}

func spawn(binary string, args []string) (*Process, error) {
	cmd := exec.Command(binary, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Process{cmd: cmd, done: make(chan struct{})}
	addrCh := make(chan string, 1)
	lastLines := make(chan []string, 1)
	// MQKV_SPAWN_LOG names a file every spawned server's log is added
	// to, for a failing test's story.
	var keep io.Writer = io.Discard
	if path := os.Getenv("MQKV_SPAWN_LOG"); path != "" {
		if f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
			keep = f
		}
	}
	go func() {
		var tail []string
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			fmt.Fprintln(keep, sc.Text())
			var rec struct {
				Msg     string `json:"msg"`
				TCP     string `json:"tcp"`
				Admin   string `json:"admin"`
				Cluster string `json:"cluster"`
			}
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.Msg == "mqkv serving" {
				p.admin, p.cluster = rec.Admin, rec.Cluster
				addrCh <- rec.TCP
			}
			if len(tail) < 20 {
				tail = append(tail, sc.Text())
			}
		}
		io.Copy(io.Discard, stderr)
		lastLines <- tail
	}()
	go func() {
		cmd.Wait()
		close(p.done)
	}()
	select {
	case p.addr = <-addrCh:
		return p, nil
	case <-p.done:
		return nil, fmt.Errorf("server exited before serving: %v", <-lastLines)
	case <-time.After(60 * time.Second):
		p.Kill()
		return nil, errors.New("server did not start within a minute")
	}
}

// Pid returns the process id of the server.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Addr returns the MQTT address of the server.
func (p *Process) Addr() string { return p.addr }

// AdminAddr and ClusterAddr return the admin endpoint's and the node
// link's addresses ("" if off).
func (p *Process) AdminAddr() string   { return p.admin }
func (p *Process) ClusterAddr() string { return p.cluster }

// CPU returns the process's user and system CPU time so far (Linux).
func (p *Process) CPU() (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name (which may hold spaces) in ")".
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) < 13 {
		return 0, errors.New("process: short /proc stat")
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100, nil // USER_HZ is 100 on Linux
}

// Kill sends SIGKILL and waits for the process to end.
func (p *Process) Kill() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Stop sends SIGTERM and waits for a clean shutdown.
func (p *Process) Stop() {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		p.Kill()
	}
}

// Signal sends sig to the process.
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }
