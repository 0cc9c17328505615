package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// cli runs the mqkv binary against s and returns stdout and the exit code.
func cli(t *testing.T, s *testServer, stdin string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(mqkvBinary(t), args...)
	cmd.Env = append(os.Environ(), "MQKV_SERVER=mqtt://"+s.Addr())
	cmd.Stdin = strings.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("mqkv %v: %v", args, err)
	}
	if code == 2 {
		t.Logf("mqkv %v stderr: %s", args, errOut.String())
	}
	return out.String(), code
}

func TestCLI(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	s := startServer(t, inMemory())
	expect := func(wantOut string, wantCode int, stdin string, args ...string) string {
		t.Helper()
		out, code := cli(t, s, stdin, args...)
		if code != wantCode || (wantOut != "*" && out != wantOut) {
			t.Fatalf("mqkv %v: exit %d, output %q; want exit %d, output %q", args, code, out, wantCode, wantOut)
		}
		return out
	}
	expect("", 1, "", "get", "greeting")
	expect("", 0, "", "set", "greeting", "hello")
	expect("hello", 0, "", "get", "greeting")
	expect("", 1, "", "set", "--nx", "greeting", "other")
	expect("", 0, "", "set", "--nex", "greeting", "hello")
	expect("", 0, "from stdin\n", "set", "piped")
	expect("from stdin\n", 0, "", "get", "piped")
	expect("", 0, "dash stdin", "set", "dashed", "-")
	file := filepath.Join(t.TempDir(), "blob")
	os.WriteFile(file, []byte{0, 1, 2, 0xff}, 0o600)
	expect("", 0, "", "set", "--file", file, "blob")
	expect("\x00\x01\x02\xff", 0, "", "get", "blob")

	out := expect("*", 0, "", "get", "--json", "greeting")
	var got map[string]any
	if err := json.Unmarshal([]byte(out), &got); err != nil || got["value"] != "hello" || got["found"] != true || got["version"] == "" || got["ttl_ms"] != nil {
		t.Fatalf("get --json: %q %v", out, err)
	}
	expect("", 0, "", "set", "--px", "60000", "session", "active")
	json.Unmarshal([]byte(expect("*", 0, "", "get", "--json", "session")), &got)
	if ttl, ok := got["ttl_ms"].(float64); !ok || ttl <= 0 || ttl > 60000 {
		t.Fatalf("ttl_ms %v", got["ttl_ms"])
	}
	// An expiry that is not positive is refused, as the server refuses
	// PX <= 0; dropping it would store a key that never expires.
	expect("", 2, "", "set", "--px", "-5", "never", "v")
	expect("", 2, "", "set", "--px", "0", "never", "v")
	expect("", 2, "", "set", "--ttl", "0s", "never", "v")
	expect("", 1, "", "get", "never")
	expect("", 0, "", "set", "--ttl", "1m", "ttl-key", "v")
	json.Unmarshal([]byte(expect("*", 0, "", "get", "--json", "ttl-key")), &got)
	if ttl, ok := got["ttl_ms"].(float64); !ok || ttl <= 0 || ttl > 60000 {
		t.Fatalf("--ttl 1m: ttl_ms %v", got["ttl_ms"])
	}
	json.Unmarshal([]byte(expect("*", 0, "", "get", "--json", "blob")), &got)
	if got["value_base64"] != "AAEC/w==" {
		t.Fatalf("binary value in JSON: %v", got)
	}
	expect("", 1, "", "vdel", "greeting", "wrong")
	expect("", 0, "", "vdel", "greeting", "hello")
	expect("", 1, "", "del", "greeting")
	expect("", 0, "", "del", "piped")
	expect("", 2, "", "set", "--fencing-token", "not-a-version", "k", "v")
	expect("", 2, "", "get", "--server", "mqtt://127.0.0.1:1", "--timeout", "500ms", "k")

	// keys lists by glob, in order; ttl reports the time left; version.
	expect("", 0, "", "set", "list/b", "2")
	expect("", 0, "", "set", "list/a", "1")
	expect("", 0, "", "set", "other", "x")
	expect("list/a\nlist/b\n", 0, "", "keys", "list/*")
	expect("list/a\n", 0, "", "keys", "--limit", "1", "--count", "1", "list/*")
	expect("{\"key\":\"list/a\"}\n{\"key\":\"list/b\"}\n", 0, "", "keys", "--json", "list/*")
	expect("", 1, "", "keys", "nothing/*")
	expect("no expiry\n", 0, "", "ttl", "list/a")
	expect("", 1, "", "ttl", "missing")
	if out := expect("*", 0, "", "ttl", "ttl-key"); !strings.HasSuffix(out, "s\n") {
		t.Fatalf("ttl of a key with 1m: %q", out)
	}
	if out := expect("*", 0, "", "version"); !strings.HasPrefix(out, "mqkv ") || !strings.Contains(out, "go1.") {
		t.Fatalf("version: %q", out)
	}
	if out := expect("*", 0, "", "--version"); !strings.HasPrefix(out, "mqkv ") {
		t.Fatalf("--version: %q", out)
	}

	// pub and sub speak plain MQTT. The subscription is in place once a
	// message shows up: publish until one does.
	sub := exec.Command(mqkvBinary(t), "sub", "--json", "--qos", "1", "cli/#")
	sub.Env = append(os.Environ(), "MQKV_SERVER=mqtt://"+s.Addr())
	var subOut lockedBuffer
	sub.Stdout = &subOut
	if err := sub.Start(); err != nil {
		t.Fatal(err)
	}
	defer sub.Process.Kill()
	for i := 0; !strings.Contains(subOut.String(), `"payload":"first"`); i++ {
		if i > 50 {
			t.Fatalf("sub printed nothing: %q", subOut.String())
		}
		expect("", 0, "", "pub", "--qos", "1", "--user-property", "k=v", "cli/a", "first")
		time.Sleep(100 * time.Millisecond)
	}
	expect("", 0, "second", "pub", "cli/b")
	eventually(t, "the second message", func() bool { return strings.Contains(subOut.String(), `"topic":"cli/b"`) })
	sub.Process.Signal(os.Interrupt)
	if err := sub.Wait(); err != nil {
		t.Fatalf("sub after SIGINT: %v", err)
	}
	if o := subOut.String(); !strings.Contains(o, `"user_properties":{"k":"v"}`) || !strings.Contains(o, `"payload":"second"`) {
		t.Fatalf("sub output:\n%s", o)
	}
	expect("", 2, "", "pub", "--qos", "3", "cli/a", "x")
	expect("", 2, "", "pub", "--user-property", "novalue", "cli/a", "x")

	// watch --pattern follows every key matching a glob.
	pw := exec.Command(mqkvBinary(t), "watch", "--pattern", "pat/*")
	pw.Env = append(os.Environ(), "MQKV_SERVER=mqtt://"+s.Addr())
	pout, _ := pw.StdoutPipe()
	if err := pw.Start(); err != nil {
		t.Fatal(err)
	}
	defer pw.Process.Kill()
	plines := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(pout)
		for sc.Scan() {
			plines <- sc.Text()
		}
	}()
	var pline string
	for i := 0; !strings.Contains(pline, "pat/new"); i++ {
		if i > 50 {
			t.Fatal("watch --pattern printed nothing for pat/new")
		}
		expect("", 0, "", "set", "nomatch", "v")
		expect("", 0, "", "set", "pat/new", "v")
		select {
		case pline = <-plines:
		case <-time.After(200 * time.Millisecond):
		}
	}
	if strings.Contains(pline, "nomatch") {
		t.Fatalf("watch --pattern printed a key outside the glob: %q", pline)
	}
	pw.Process.Signal(os.Interrupt)
	pw.Wait()

	// watch prints changes until interrupted.
	w := exec.Command(mqkvBinary(t), "watch", "watched")
	w.Env = append(os.Environ(), "MQKV_SERVER=mqtt://"+s.Addr())
	stdout, _ := w.StdoutPipe()
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	defer w.Process.Kill()
	lines := bufio.NewScanner(stdout)
	// The watch is registered once a change shows up; keep changing
	// until it does.
	seen := make(chan string, 10)
	go func() {
		for lines.Scan() {
			seen <- lines.Text()
		}
	}()
	var first string
	for i := 0; first == ""; i++ {
		if i > 50 {
			t.Fatal("watch printed nothing")
		}
		expect("", 0, "", "set", "watched", "v1")
		select {
		case first = <-seen:
		case <-time.After(200 * time.Millisecond):
		}
	}
	if !strings.HasPrefix(first, `SET "watched" `) || !strings.HasSuffix(first, `"v1"`) {
		t.Fatalf("watch line %q", first)
	}
	expect("", 0, "", "del", "watched")
	for line := range seen {
		if strings.HasPrefix(line, `DELETE "watched" `) {
			break
		}
	}
	w.Process.Signal(os.Interrupt)
	if err := w.Wait(); err != nil {
		t.Fatalf("watch after SIGINT: %v", err)
	}

	// lock passes a working fencing token to the command, and its exit code.
	script := `mqkv set --fencing-token "$MQKV_FENCING_TOKEN" fenced "written under $MQKV_LOCK_NAME" && exit 7`
	cmd := exec.Command(mqkvBinary(t), "lock", "--ttl", "5s", "job", "--", "sh", "-c", script)
	cmd.Env = append(os.Environ(), "MQKV_SERVER=mqtt://"+s.Addr(), "PATH="+filepath.Dir(mqkvBinary(t))+":"+os.Getenv("PATH"))
	if err := cmd.Run(); err == nil {
		t.Fatal("lock: want the command's exit status 7")
	} else if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 7 {
		t.Fatalf("lock: %v", err)
	}
	expect("written under job", 0, "", "get", "fenced")
	// The key is fenced now: a write without the token is refused.
	expect("", 2, "", "set", "fenced", "intruder")
	expect("", 1, "", "get", "job") // released
}

// TestCLILockSignalsAndLoss: mqkv lock passes signals to its command and
// keeps the lease until the command ends; a lease lost under the command
// stops it and makes mqkv fail saying so.
func TestCLILockSignalsAndLoss(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	s := startServer(t, inMemory())
	start := func(name, ttl string) (*exec.Cmd, func() string, *bytes.Buffer) {
		script := `trap 'echo got-term; exit 0' TERM; echo ready; while :; do sleep 0.05; done`
		cmd := exec.Command(mqkvBinary(t), "lock", "--ttl", ttl, "--grace", "5s", name, "--", "sh", "-c", script)
		cmd.Env = append(os.Environ(), "MQKV_SERVER=mqtt://"+s.Addr())
		// A group of its own, so that cleanup also ends the command.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) })
		lines := make(chan string, 10)
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				lines <- sc.Text()
			}
			close(lines)
		}()
		next := func() string {
			select {
			case l := <-lines:
				return l
			case <-time.After(15 * time.Second):
				return "(nothing within 15 s)"
			}
		}
		if l := next(); l != "ready" {
			t.Fatalf("command did not start: %q %s", l, stderr.String())
		}
		return cmd, next, &stderr
	}

	// SIGTERM to mqkv reaches the command, which ends normally; the lease
	// is released after.
	cmd, next, stderr := start("sig", "5s")
	if out, code := cli(t, s, "", "get", "sig"); code != 0 || out == "" {
		t.Fatalf("lease not held while the command runs: %q %d", out, code)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if l := next(); l != "got-term" {
		t.Fatalf("command did not get SIGTERM: %q", l)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("mqkv lock after SIGTERM: %v %s", err, stderr)
	}
	if _, code := cli(t, s, "", "get", "sig"); code != 1 {
		t.Fatal("lease not released")
	}

	// Another holder takes the lease: the command is stopped, mqkv exits 2.
	cmd, next, stderr = start("taken", "600ms")
	if _, code := cli(t, s, "", "set", "taken", "someone-else"); code != 0 {
		t.Fatal("set")
	}
	if l := next(); l != "got-term" {
		t.Fatalf("command not stopped when the lease was lost: %q", l)
	}
	err := cmd.Wait()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || !strings.Contains(stderr.String(), "lost") {
		t.Fatalf("mqkv lock after losing the lease: %v %q", err, stderr)
	}
	if out, _ := cli(t, s, "", "get", "taken"); out != "someone-else" {
		t.Fatalf("the new holder's lease was touched: %q", out)
	}
}

// TestCLIErrorsNameTheFix: the mistakes a new user makes first get an error
// that says what to do.
func TestCLIErrorsNameTheFix(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	s := startServer(t, inMemory(), withTLS(newPKI(t), false))
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"status", "--admin", "http://" + s.Addr()}, "start the server with --admin-listen"},
		{[]string{"get", "--server", "mqtt://" + s.Addrs()["tls"], "--timeout", "3s", "k"}, "use tls://" + s.Addrs()["tls"]},
	} {
		out, err := exec.Command(mqkvBinary(t), c.args...).CombinedOutput()
		if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 || !strings.Contains(string(out), c.want) {
			t.Fatalf("mqkv %v: %v\n%s\nwant exit 2 and %q", c.args, err, out, c.want)
		}
		if strings.Count(string(out), strings.TrimPrefix(c.args[2], "mqtt://")) > 2 {
			t.Fatalf("mqkv %v repeats the address: %s", c.args, out)
		}
	}
}
