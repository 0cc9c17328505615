package e2e

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/mqkv/mqkv/internal/admin"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/server"
)

func withAdmin() serverOption { return func(c *server.Config) { c.AdminListen = "127.0.0.1:0" } }

func httpGet(t *testing.T, url string) (int, []byte) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// metric reads one sample of a metric family (with the given labels): a
// counter's or gauge's value, a histogram's count.
func metric(t *testing.T, base, name string, labels map[string]string) float64 {
	t.Helper()
	v, _ := histogram(t, base, name, labels)
	return v
}

// histogram reads one sample of a metric family as metric does, and a
// histogram's sum besides.
func histogram(t *testing.T, base, name string, labels map[string]string) (value, sum float64) {
	t.Helper()
	code, body := httpGet(t, base+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		t.Fatalf("/metrics does not parse: %v", err)
	}
	f := fams[name]
	if f == nil {
		return 0, 0 // a vector without samples yet is not exported
	}
next:
	for _, m := range f.Metric {
		for _, l := range m.Label {
			if want, ok := labels[l.GetName()]; ok && want != l.GetValue() {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), 0
		case m.Gauge != nil:
			return m.Gauge.GetValue(), 0
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), m.Histogram.GetSampleSum()
		}
	}
	return 0, 0
}

func TestAdminEndpoint(t *testing.T) {
	skipInCluster(t, "a member's key and byte gauges count only the groups it leads")
	s := startServer(t, withAdmin())
	base := "http://" + s.AdminAddr()
	for path, want := range map[string]int{"/healthz": 200, "/readyz": 200, "/debug/pprof/": 200, "/": 200, "/nope": 404} {
		if code, _ := httpGet(t, base+path); code != want {
			t.Errorf("%s: %d, want %d", path, code, want)
		}
	}
	before := metric(t, base, "mqkv_requests_total", map[string]string{"command": "SET", "result": "ok"})
	c := dialRaw(t, s, "admin-traffic", rawOpts{cleanStart: true})
	for i := 0; i < 5; i++ {
		c.call("SET", fmt.Sprintf("m/%d", i), "v")
	}
	c.call("GET", "m/0")
	c.call("GET", "missing")
	c.call("SET", "", "v")
	expectPayload(t, c.call("KEYNOTIFY", "m/1"), "+OK\r\n")
	checks := []struct {
		name   string
		labels map[string]string
		min    float64
	}{
		{"mqkv_requests_total", map[string]string{"command": "SET", "result": "ok"}, before + 5},
		{"mqkv_requests_total", map[string]string{"command": "GET", "result": "miss"}, 1},
		{"mqkv_requests_total", map[string]string{"command": "SET", "result": "error"}, 1},
		{"mqkv_request_duration_seconds", map[string]string{"command": "SET"}, 5},
		{"mqkv_keys", nil, 5},
		{"mqkv_bytes", nil, 5 * 4},
		{"mqkv_keynotify_registrations", nil, 1},
		{"mqkv_mqtt_clients_connected", nil, 1},
		{"mqkv_mqtt_messages_received_total", nil, 9},
		{"mqkv_mqtt_messages_sent_total", nil, 9},
		{"mqkv_raft_commit_seconds", nil, 1},
		{"mqkv_log_append_seconds", nil, 1},
		{"mqkv_log_entry_commands", nil, 1},
	}
	for _, ch := range checks {
		if got := metric(t, base, ch.name, ch.labels); got < ch.min {
			t.Errorf("%s%v = %v, want ≥ %v", ch.name, ch.labels, got, ch.min)
		}
	}
	// Every write above is a command of some entry: five in at most five.
	if entries, cmds := histogram(t, base, "mqkv_log_entry_commands", nil); cmds < 5 || cmds < entries {
		t.Errorf("log entries %v holding %v commands, want ≥ 5 commands and ≥ 1 per entry", entries, cmds)
	}
	// A change is told to its observers after it is applied, not before
	// the writer's reply: wait for the notification, then for its count.
	c.call("SET", "m/1", "changed")
	if p, ok := c.nextPublish(5 * time.Second); !ok || !strings.Contains(p.Topic, "/command/notify/") {
		t.Fatalf("no notification of m/1's change: %v", p)
	}
	eventuallyWithin(t, 5*time.Second, "mqkv_notifications_sent_total to move", func() bool {
		return metric(t, base, "mqkv_notifications_sent_total", nil) >= 1
	})
	c.call("SET", "short", "v", "PX", "50")
	eventuallyWithin(t, 5*time.Second, "mqkv_expired_total to move", func() bool { return metric(t, base, "mqkv_expired_total", nil) >= 1 })

	// Status, as `mqkv status` reads it.
	var st admin.Status
	_, body := httpGet(t, base+"/v1/status")
	if err := json.Unmarshal(body, &st); err != nil || st.NodeID != s.NodeID || st.Keys < 5 || !st.Leader || st.Requests < 9 {
		t.Fatalf("status %+v %v", st, err)
	}

	// Key browser: list by glob, then delete through the log.
	_, body = httpGet(t, base+"/v1/keys?match=m/*&limit=3")
	var page struct {
		Keys []admin.KeyInfo `json:"keys"`
		Next string          `json:"next"`
	}
	if err := json.Unmarshal(body, &page); err != nil || len(page.Keys) != 3 || page.Keys[0].Key != "m/0" || page.Next == "" {
		t.Fatalf("keys page 1: %s", body)
	}
	_, body = httpGet(t, base+"/v1/keys?match=m/*&limit=3&after="+page.Next)
	page.Keys, page.Next = nil, ""
	json.Unmarshal(body, &page)
	if len(page.Keys) != 2 || page.Keys[1].Key != "m/4" || page.Next != "" {
		t.Fatalf("keys page 2: %s", body)
	}
	del := base + "/v1/keys/delete?key=" + hex.EncodeToString([]byte("m/0"))
	// A plain POST, as a cross-site form would send it, changes nothing.
	resp, err := http.Post(del, "", nil)
	if err != nil || resp.StatusCode != http.StatusForbidden {
		t.Fatalf("delete without %s: %v %v", admin.RequestHeader, resp, err)
	}
	expectPayload(t, c.call("GET", "m/0"), "$1\r\nv\r\n")
	req, _ := http.NewRequest(http.MethodPost, del, nil)
	req.Header.Set(admin.RequestHeader, "1")
	resp, err = http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("delete: %v %v", resp, err)
	}
	expectPayload(t, c.call("GET", "m/0"), "$-1\r\n")
	// A backup copies the whole store: a plain GET, as a cross-site image
	// would send it, is refused too.
	if resp, err := http.Get(base + "/v1/backup"); err != nil || resp.StatusCode != http.StatusForbidden {
		t.Fatalf("backup without %s: %v %v", admin.RequestHeader, resp, err)
	}
}

// TestAdminRefusesForeignHosts: a browser led to the endpoint under a name
// that is not the operator's (DNS rebinding) is refused; IP addresses,
// localhost and --admin-allowed-hosts names are served.
func TestAdminRefusesForeignHosts(t *testing.T) {
	s := startServer(t, inMemory(), withAdmin(), func(c *server.Config) { c.AdminAllowedHosts = []string{"mqkv.internal"} })
	_, port, _ := net.SplitHostPort(s.AdminAddr())
	for host, want := range map[string]int{
		"127.0.0.1:" + port:        200,
		"[::1]:" + port:            200,
		"localhost:" + port:        200,
		"LOCALHOST":                200,
		"mqkv.internal:" + port:    200,
		"attacker.example:" + port: http.StatusMisdirectedRequest,
		"127.0.0.1.nip.io":         http.StatusMisdirectedRequest,
	} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+s.AdminAddr()+"/v1/status", nil)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("Host %s: %d, want %d", host, resp.StatusCode, want)
		}
	}
	// Probes and scrapers may use any name: these hold no keys.
	for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
		req, _ := http.NewRequest(http.MethodGet, "http://"+s.AdminAddr()+path, nil)
		req.Host = "mqkv-0.mqkv.svc:" + port
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%s under a DNS name: %d", path, resp.StatusCode)
		}
	}
}

// TestAdminLiveViewersAreBounded: the live change feed serves a bounded
// number of viewers; the next one is told so, and a place frees when a
// viewer leaves.
func TestAdminLiveViewersAreBounded(t *testing.T) {
	s := startServer(t, inMemory(), withAdmin())
	url := "http://" + s.AdminAddr() + "/v1/events"
	open := func() *http.Response {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { resp.Body.Close() })
		return resp
	}
	var viewers []*http.Response
	for i := 0; i < 32; i++ {
		r := open()
		if r.StatusCode != 200 {
			t.Fatalf("viewer %d: %d", i, r.StatusCode)
		}
		viewers = append(viewers, r)
	}
	if r := open(); r.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("viewer 33: %d, want 503", r.StatusCode)
	}
	viewers[0].Body.Close()
	eventually(t, "a freed place", func() bool {
		r := open()
		r.Body.Close()
		return r.StatusCode == 200
	})
}

// TestBackupRestore takes a backup while writers run, restores it, and
// checks the restored server holds exactly the writes up to the backup
// point: a write is in it if and only if its version is at most the
// backup's greatest version.
func TestBackupRestore(t *testing.T) {
	t.Parallel()
	skipInCluster(t, "a cluster backup copies each group at its own point: TestClusterBackupRestore")
	if testing.Short() {
		t.Skip("builds the binary")
	}
	s := startServer(t, withAdmin())
	base := "http://" + s.AdminAddr()
	type write struct {
		key, version string
	}
	var mu sync.Mutex
	var acked []write
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		c := dialRaw(t, s, fmt.Sprintf("backup-writer-%d", w), rawOpts{cleanStart: true})
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("w%d/%d", w, i)
				p := c.call("SET", key, "v")
				ts, _ := userProp(p, "__ts")
				mu.Lock()
				acked = append(acked, write{key, ts})
				mu.Unlock()
			}
		}(w)
	}
	time.Sleep(300 * time.Millisecond)
	file := filepath.Join(t.TempDir(), "backup.snap")
	out, err := exec.Command(mqkvBinary(t), "backup", "--admin", base, "--out", file).CombinedOutput()
	if err != nil {
		t.Fatalf("mqkv backup: %v\n%s", err, out)
	}
	time.Sleep(200 * time.Millisecond) // writes after the backup
	close(stop)
	wg.Wait()
	m := versionAfter(string(out))
	point, err := hlc.Parse(m)
	if err != nil {
		t.Fatalf("backup output %q", out)
	}

	dir := filepath.Join(t.TempDir(), "restored")
	if out, err := exec.Command(mqkvBinary(t), "restore", "--in", file, "--data-dir", dir).CombinedOutput(); err != nil {
		t.Fatalf("mqkv restore: %v\n%s", err, out)
	}
	// The same backup through standard output and standard input.
	piped, err := exec.Command(mqkvBinary(t), "backup", "--admin", base, "--out", "-").Output()
	if err != nil || len(piped) == 0 {
		t.Fatalf("mqkv backup --out -: %v (%d bytes)", err, len(piped))
	}
	if _, err := os.Stat("-"); err == nil {
		t.Fatal("backup --out - wrote a file named -")
	}
	dir2 := filepath.Join(t.TempDir(), "restored-from-stdin")
	restore := exec.Command(mqkvBinary(t), "restore", "--in", "-", "--data-dir", dir2)
	restore.Stdin = bytes.NewReader(piped)
	if out, err := restore.CombinedOutput(); err != nil || !strings.Contains(string(out), "keys") {
		t.Fatalf("mqkv restore --in -: %v\n%s", err, out)
	}

	r := startServerIn(t, dir)
	c := dialRaw(t, r, "checker", rawOpts{cleanStart: true})
	in, outAfter := 0, 0
	for _, w := range acked {
		v, _ := hlc.Parse(w.version)
		got := string(c.call("GET", w.key).Payload)
		if v.Compare(point) <= 0 {
			in++
			if got != "$1\r\nv\r\n" {
				t.Fatalf("%s (version %s, before the backup point %s) missing after restore", w.key, w.version, point)
			}
		} else {
			outAfter++
			if got != "$-1\r\n" {
				t.Fatalf("%s (version %s, after the backup point %s) present after restore", w.key, w.version, point)
			}
		}
	}
	if in == 0 || outAfter == 0 {
		t.Fatalf("the backup did not fall inside the write load: %d writes before, %d after", in, outAfter)
	}
	// The restored node goes on: new versions above the backup's.
	p := c.call("SET", "new", "v")
	ts, _ := userProp(p, "__ts")
	if v, _ := hlc.Parse(ts); v.Compare(point) <= 0 {
		t.Fatalf("new version %s not above %s", ts, point)
	}
	t.Logf("%d writes in the backup, %d after it", in, outAfter)

	// A corrupt backup is refused with a clear message, and nothing is
	// created.
	data, _ := os.ReadFile(file)
	data[len(data)/2] ^= 0xff
	bad := filepath.Join(t.TempDir(), "bad.snap")
	os.WriteFile(bad, data, 0o600)
	badDir := filepath.Join(t.TempDir(), "bad")
	out, err = exec.Command(mqkvBinary(t), "restore", "--in", bad, "--data-dir", badDir).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "not a valid backup") {
		t.Fatalf("corrupt backup: %v\n%s", err, out)
	}
	if _, err := os.Stat(badDir); err == nil {
		t.Fatal("a refused restore left a data directory behind")
	}
	// An empty directory the operator made for it stays, empty.
	os.Mkdir(badDir, 0o700)
	if _, err := exec.Command(mqkvBinary(t), "restore", "--in", bad, "--data-dir", badDir).CombinedOutput(); err == nil {
		t.Fatal("corrupt backup accepted")
	}
	if entries, err := os.ReadDir(badDir); err != nil || len(entries) != 0 {
		t.Fatalf("the operator's directory after a refused restore: %v %v", entries, err)
	}
	// Restoring over existing data is refused too.
	if out, err := exec.Command(mqkvBinary(t), "restore", "--in", file, "--data-dir", dir).CombinedOutput(); err == nil {
		t.Fatalf("restore over existing data: %s", out)
	}
}

// versionAfter returns what follows "up to version " in the output.
func versionAfter(s string) string {
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if i := strings.Index(sc.Text(), "up to version "); i >= 0 {
			return strings.TrimSpace(sc.Text()[i+len("up to version "):])
		}
	}
	return ""
}

// TestTopShowsActivity: mqkv top shows the busiest clients and the hottest
// keys, and writes no screen codes when piped.
func TestTopShowsActivity(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	s := startServer(t, inMemory(), withAdmin())
	c := dialRaw(t, s, "busy-reader", rawOpts{cleanStart: true})
	top := exec.Command(mqkvBinary(t), "top", "--admin", "http://"+s.AdminAddr())
	var out lockedBuffer
	top.Stdout = &out
	if err := top.Start(); err != nil {
		t.Fatal(err)
	}
	defer top.Process.Kill()
	eventually(t, "mqkv top's activity", func() bool {
		for range 20 {
			c.call("GET", "hot/key")
		}
		o := out.String()
		return strings.Contains(o, `"hot/key"`) && strings.Contains(o, "busy-reader")
	})
	top.Process.Signal(os.Interrupt)
	top.Wait()
	if strings.Contains(out.String(), "\x1b[") {
		t.Fatal("mqkv top wrote screen codes into a pipe")
	}
}

func adminPost(t *testing.T, url string, body any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(b))
	req.Header.Set(admin.RequestHeader, "1")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}

// TestAdminSetBoundsTheTTL: a ttl_ms past the store's bound overflowed the
// deadline into the past: the write was answered "applied" and the key,
// old value included, was gone at once. It is refused now, nothing
// written, as MQTT's PX is.
func TestAdminSetBoundsTheTTL(t *testing.T) {
	s := startServer(t, withAdmin())
	base := "http://" + s.AdminAddr()
	c := dialRaw(t, s, "admin-ttl", rawOpts{cleanStart: true})
	expectPayload(t, c.call("SET", "k", "precious"), "+OK\r\n")
	code, body := adminPost(t, base+"/v1/keys/set", map[string]any{
		"key_hex": hex.EncodeToString([]byte("k")), "value": "new", "ttl_ms": int64(math.MaxInt64)})
	if code != http.StatusBadRequest || !strings.Contains(string(body), "ttl_ms") {
		t.Fatalf("ttl_ms MaxInt64: %d %s", code, body)
	}
	expectPayload(t, c.call("GET", "k"), "$8\r\nprecious\r\n")
}

// TestAdminEditKeepsALongValue: the key browser shows the first 4 KiB of a
// value; the console's editor saved that preview back, so changing only
// the expiry of a 5,000-byte value cut it to 4,096 bytes. For such a value
// the console now sends keep_value (what this replays): the expiry
// changes, the value stays whole; and keep_value never writes over a
// newer version.
func TestAdminEditKeepsALongValue(t *testing.T) {
	s := startServer(t, withAdmin())
	base := "http://" + s.AdminAddr()
	c := dialRaw(t, s, "admin-edit", rawOpts{cleanStart: true})
	big := strings.Repeat("x", 5000)
	expectPayload(t, c.call("SET", "doc", big), "+OK\r\n")
	_, body := httpGet(t, base+"/v1/keys?match=doc")
	var page struct {
		Keys []admin.KeyInfo `json:"keys"`
	}
	if err := json.Unmarshal(body, &page); err != nil || len(page.Keys) != 1 {
		t.Fatalf("keys: %s", body)
	}
	k := page.Keys[0]
	if k.Size != 5000 || len(k.Value) >= 5000 {
		t.Fatalf("the browser shows %d of %d bytes: no preview to test", len(k.Value), k.Size)
	}
	code, out := adminPost(t, base+"/v1/keys/set", map[string]any{
		"key_hex": k.KeyHex, "keep_value": true, "ttl_ms": 3600000, "version": k.Version})
	if code != http.StatusOK {
		t.Fatalf("save: %d %s", code, out)
	}
	expectPayload(t, c.call("GET", "doc"), "$5000\r\n"+big+"\r\n")
	if p := c.call("PTTL", "doc"); len(p.Payload) < 2 || p.Payload[0] != ':' || p.Payload[1] == '-' {
		t.Fatalf("no expiry after the edit: %q", p.Payload)
	}
	expectPayload(t, c.call("SET", "doc", "newer"), "+OK\r\n")
	if code, out := adminPost(t, base+"/v1/keys/set", map[string]any{
		"key_hex": k.KeyHex, "keep_value": true, "ttl_ms": 1000, "version": k.Version}); code != http.StatusConflict {
		t.Fatalf("keep_value over a newer version: %d %s", code, out)
	}
	expectPayload(t, c.call("GET", "doc"), "$5\r\nnewer\r\n")
}

// TestPortTakenFailsFirst: a start whose admin or gateway port is taken
// fails before it does anything else: no cluster created in its data
// directory, its MQTT port free again (a CI run's node created its
// cluster, then exited on the admin port).
func TestPortTakenFailsFirst(t *testing.T) {
	t.Parallel()
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	for name, set := range map[string]func(*server.Config, string){
		"admin listener": func(c *server.Config, a string) { c.AdminListen = a },
		"resp":           func(c *server.Config, a string) { c.RESPListen = a },
		"memcache":       func(c *server.Config, a string) { c.MemcacheListen = a },
		"http":           func(c *server.Config, a string) { c.HTTPListen = a },
	} {
		dir := t.TempDir()
		mqtt := freePort(t)
		cfg := server.Config{Listen: mqtt, DataDir: dir, Logger: quietLogger(),
			Cluster: server.ClusterConfig{NodeID: "taken", Listen: "127.0.0.1:0", Groups: 2}}
		set(&cfg, taken.Addr().String())
		_, err = server.Start(cfg)
		if err == nil || !strings.HasPrefix(err.Error(), name+":") {
			t.Fatalf("start with a taken %s port: %v", name, err)
		}
		if _, err := os.Stat(filepath.Join(dir, "cluster")); !os.IsNotExist(err) {
			t.Fatalf("%s: the failed start left its cluster directory: %v", name, err)
		}
		ln, err := net.Listen("tcp", mqtt)
		if err != nil {
			t.Fatalf("%s: the failed start kept its MQTT port: %v", name, err)
		}
		ln.Close()
	}
}
