package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// process is a child server.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
	log  string // its server.log
}

func spawn(dir, name string, args ...string) (*process, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "server.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(name, args...)
	if serverCPU != "" {
		// taskset execs the server in its own place: the pid, and so
		// the CPU read from /proc, are the server's.
		cmd = exec.Command("taskset", append([]string{"-c", serverCPU, name}, args...)...)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w (run bench/peers/run.sh, which installs it)", name, err)
	}
	p := &process{cmd: cmd, done: make(chan struct{}), log: logf.Name()}
	go func() { cmd.Wait(); logf.Close(); close(p.done) }()
	return p, nil
}

func (p *process) stop() {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
}

// cpu returns the user and system time the process has used so far.
func (p *process) cpu() (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name (which may hold spaces): state is
	// field 3, utime 14, stime 15.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	const ticks = 100 // USER_HZ on Linux
	return time.Duration(utime+stime) * time.Second / ticks, nil
}

// freeAddr is a loopback address with a port nobody listens on now.
func freeAddr() (string, error) {
	port, err := freePort()
	return fmt.Sprintf("127.0.0.1:%d", port), err
}

// freePort picks a loopback port nobody listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// awaitListening waits until addr accepts connections.
func awaitListening(p *process, addr string) error {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("the server exited at start (%v); the end of its log:\n%s", p.cmd.ProcessState, p.logTail())
		case <-time.After(50 * time.Millisecond):
		}
	}
	p.stop()
	return fmt.Errorf("%s not listening after 30 s", addr)
}

// logTail is the last lines of p's log: the working directory, and so
// the log, goes when the run ends.
func (p *process) logTail() string {
	b, _ := os.ReadFile(p.log)
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-20):], "\n")
}

func buildMQKV(out string) error {
	root, err := repoRoot()
	if err != nil {
		return err
	}
	cmd := exec.Command("go", "build", "-o", out, "./cmd/mqkv")
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build mqkv: %v\n%s", err, b)
	}
	return nil
}

// repoRoot is the main module's directory: the nearest parent of the
// working directory whose go.mod names github.com/mqkv/mqkv.
func repoRoot() (string, error) {
	dir, _ := os.Getwd()
	for {
		f, err := os.Open(filepath.Join(dir, "go.mod"))
		if err == nil {
			sc := bufio.NewScanner(f)
			sc.Scan()
			f.Close()
			if strings.TrimSpace(sc.Text()) == "module github.com/mqkv/mqkv" {
				return dir, nil
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("run from inside the mqkv repository, or give -mqkv")
		}
		dir = parent
	}
}

// mqkvAdmin, if set, is where mqkv serves its admin endpoint (pprof).
var mqkvAdmin string

// profiling has mqkv serve its admin endpoint on a port of its own (each
// node of a cluster), for CPU profiles.
var profiling bool

// serverCPU, if set, is the CPU list (taskset -c) every server runs on.
var serverCPU string

// startMQKV runs mqkv durable (the default) on a fresh data dir.
func startMQKV(bin, dir string) (*server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	args := []string{"serve", "--listen", addr, "--data-dir", filepath.Join(dir, "data")}
	admin := mqkvAdmin
	if admin == "" && profiling {
		if admin, err = freeAddr(); err != nil {
			return nil, err
		}
	}
	if admin != "" {
		args = append(args, "--admin-listen", admin)
	}
	p, err := spawn(dir, bin, args...)
	if err != nil {
		return nil, err
	}
	s := &server{name: "mqkv", proc: p, addr: addr}
	if profiling {
		s.admin = []string{admin}
	}
	return s, awaitListening(p, addr)
}

// startEtcd runs one etcd member with its defaults (fsync on every
// commit) on a fresh data dir.
func startEtcd(dir string) (*server, error) {
	client, err := freePort()
	if err != nil {
		return nil, err
	}
	peerPort, err := freePort()
	if err != nil {
		return nil, err
	}
	cu := fmt.Sprintf("http://127.0.0.1:%d", client)
	pu := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	p, err := spawn(dir, "etcd", "--name", "bench", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", cu, "--advertise-client-urls", cu,
		"--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
		"--initial-cluster", "bench="+pu, "--log-level", "warn")
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", client)
	return &server{name: "etcd", proc: p, addr: addr}, awaitListening(p, addr)
}

// startMosquitto runs mosquitto 2 with a listener on a private port,
// anonymous clients allowed, no persistence (the pub/sub workload uses
// clean sessions, which mosquitto never writes anyway).
func startMosquitto(dir string) (*server, error) { return startMosquittoWith(dir) }

// startMosquittoWith is startMosquitto with more configuration lines.
func startMosquittoWith(dir string, extra ...string) (*server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	conf := filepath.Join(dir, "mosquitto.conf")
	text := fmt.Sprintf("listener %d 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 10000\n", port)
	for _, e := range extra {
		text += e + "\n"
	}
	err = os.WriteFile(conf, []byte(text), 0o600)
	if err != nil {
		return nil, err
	}
	p, err := spawn(dir, "mosquitto", "-c", conf)
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	return &server{name: "mosquitto", proc: p, addr: addr}, awaitListening(p, addr)
}

// startMQKVMemcache runs mqkv durable with its memcached endpoint; the
// server's address is that endpoint's.
func startMQKVMemcache(bin, dir string) (*server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	mport, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", mport)
	p, err := spawn(dir, bin, "serve", "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--memcache-listen", addr,
		"--data-dir", filepath.Join(dir, "data"))
	if err != nil {
		return nil, err
	}
	return &server{name: "mqkv", proc: p, addr: addr}, awaitListening(p, addr)
}

// startMemcached runs Debian's memcached (in memory: it keeps nothing on
// disk) with 256 MiB and 4 threads, its defaults but the memory.
func startMemcached(dir string) (*server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	p, err := spawn(dir, "memcached", "-l", "127.0.0.1", "-p", fmt.Sprint(port), "-U", "0", "-m", "256", "-u", "root")
	if err != nil {
		return nil, err
	}
	return &server{name: "memcached", proc: p, addr: addr}, awaitListening(p, addr)
}

// startMQKVHTTP runs mqkv durable with its HTTP endpoint; the server's
// address is that endpoint's.
func startMQKVHTTP(bin, dir string) (*server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	hport, err := freePort()
	if err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", hport)
	p, err := spawn(dir, bin, "serve", "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--http-listen", addr,
		"--data-dir", filepath.Join(dir, "data"))
	if err != nil {
		return nil, err
	}
	return &server{name: "mqkv", proc: p, addr: addr}, awaitListening(p, addr)
}

// startMQKVAttached runs mosquitto (with TCP_NODELAY and 1,000 messages
// in flight per client) and mqkv attached to it (mqkv attach, durable);
// the server's address is mosquitto's, its CPU both processes'.
func startMQKVAttached(bin, dir string) (*server, error) {
	// Without TCP_NODELAY mosquitto holds a reply behind the client's
	// delayed acknowledgement of its PUBACK: 44 ms a request (docs/attach.md).
	m, err := startMosquittoWith(filepath.Join(dir, "mosquitto"), "set_tcp_nodelay true", "max_inflight_messages 1000")
	if err != nil {
		return nil, err
	}
	admin, err := freeAddr()
	if err != nil {
		m.stop()
		return nil, err
	}
	p, err := spawn(filepath.Join(dir, "mqkv"), bin, "attach", "--broker", "mqtt://"+m.addr, "--data-dir", filepath.Join(dir, "mqkv", "data"),
		"--admin-listen", admin)
	if err != nil {
		m.stop()
		return nil, err
	}
	s := &server{name: "mqkv attached", proc: m.proc, more: []*process{p}, addr: m.addr, parts: []string{"mosquitto", "mqkv"}}
	if profiling {
		s.admin = []string{admin}
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var st struct {
			Attached *struct {
				Serving bool `json:"serving"`
			} `json:"attached"`
		}
		resp, err := http.Get("http://" + admin + "/v1/status")
		if err == nil {
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
		}
		if err == nil && st.Attached != nil && st.Attached.Serving {
			return s, nil
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("mqkv did not attach to mosquitto within 30 s (%v)", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
