package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/server"
)

// browser returns the path of a Chromium, or skips the test when there is
// none and MQKV_REQUIRE_BROWSER is not set (.ci/run installs Chromium and
// sets it).
func browser(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("MQKV_REQUIRE_BROWSER") != "" {
		t.Fatal("no Chromium found, and MQKV_REQUIRE_BROWSER is set")
	}
	t.Skip("no Chromium (install Debian's chromium, as .ci/run does)")
	return ""
}

// TestConsole drives the web console in a real headless Chromium: it loads
// without console errors, its key browser lists a key written over MQTT,
// and its live feed shows a change made after the page opened.
func TestConsole(t *testing.T) {
	exe := browser(t)
	s := startServer(t, withAdmin())
	c := dialRaw(t, s, "console-writer", rawOpts{cleanStart: true})
	expectPayload(t, c.call("SET", "sensors/site-1/temp", "21.5"), "+OK\r\n")
	expectPayload(t, c.call("SET", "config/site", `{"mode":"auto"}`, "PX", "3600000"), "+OK\r\n")
	expectPayload(t, c.call("SET", "firmware/blob", "\x00\x01\xfe\xff"), "+OK\r\n")

	ctx, problems := openBrowser(t, exe)
	base := "http://" + s.AdminAddr() + "/"
	if err := chromedp.Do(ctx, chromedp.Navigate(base), chromedp.WaitVisible(`#keys tr[data-key]`)); err != nil {
		t.Fatal(err)
	}
	keysText, err := chromedp.Run(ctx, chromedp.Text(`#keys`))
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"sensors/site-1/temp", "config/site", "firmware/blob"} {
		if !strings.Contains(keysText, k) {
			t.Fatalf("key browser does not list %q:\n%s", k, keysText)
		}
	}

	// A change after the page opened shows up in the live feed, without a
	// reload. The feed's connection may still be opening: change until it
	// shows.
	var feedText string
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; !strings.Contains(feedText, "sensors/site-1/temp") || !strings.Contains(feedText, "22."); i++ {
		if time.Now().After(deadline) {
			t.Fatalf("live feed never showed the change:\n%s", feedText)
		}
		expectPayload(t, c.call("SET", "sensors/site-1/temp", fmt.Sprintf("22.%d", i)), "+OK\r\n")
		time.Sleep(200 * time.Millisecond)
		feedText, _ = chromedp.Run(ctx, chromedp.Text(`#feed`))
	}

	// Filter by glob.
	err = chromedp.Do(ctx,
		chromedp.SetValue(`#filter`, "config/*"),
		chromedp.Click(`#filter-form button`),
		chromedp.Sleep(300*time.Millisecond),
	)
	if err != nil {
		t.Fatal(err)
	}
	filtered, err := chromedp.Run(ctx, chromedp.Text(`#keys`))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(filtered, "config/site") || strings.Contains(filtered, "sensors/") {
		t.Fatalf("glob filter config/*:\n%s", filtered)
	}
	// Show everything again for the screenshot, once the overview chart
	// has a few seconds of history with some traffic in it.
	load := make(chan struct{})
	go func() {
		defer close(load)
		for end := time.Now().Add(4 * time.Second); time.Now().Before(end); {
			c.call("SET", fmt.Sprintf("sensors/site-%d/humidity", time.Now().UnixNano()%7), "48")
		}
	}()
	err = chromedp.Do(ctx,
		chromedp.SetValue(`#filter`, "*"),
		chromedp.Click(`#filter-form button`),
		chromedp.Sleep(4500*time.Millisecond),
	)
	<-load
	if err != nil {
		t.Fatal(err)
	}
	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "console.png")
	if os.Getenv("MQKV_UPDATE_SCREENSHOT") != "" {
		out = "../../docs/console.png"
	}
	if err := os.WriteFile(out, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	if p := problems(); len(p) > 0 {
		t.Fatalf("the page reported errors:\n%s", strings.Join(p, "\n"))
	}
}

// openBrowser starts a headless Chromium for the test and returns its
// context and a function that reports the page's console errors and
// exceptions so far.
func openBrowser(t *testing.T, exe string) (context.Context, func() []string) {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(exe),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-quic", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1366, 900),
	)
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancel)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(cancel)
	ctx, cancel = context.WithTimeout(ctx, 60*time.Second)
	t.Cleanup(cancel)

	var mu sync.Mutex
	var problems []string
	err := chromedp.Listen(ctx, func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		switch ev := ev.(type) {
		case *runtime.EventConsoleAPICalled:
			if ev.Type == runtime.ConsoleAPICalledTypeError || ev.Type == runtime.ConsoleAPICalledTypeAssert {
				problems = append(problems, fmt.Sprintf("console.%s: %v", ev.Type, ev.Args))
			}
		case *runtime.EventExceptionThrown:
			problems = append(problems, fmt.Sprintf("exception: %s %+v", ev.ExceptionDetails.Text, ev.ExceptionDetails.Exception))
		}
	})
	if err != nil {
		t.Fatal(err)
	}

	return ctx, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), problems...)
	}
}

// TestConsoleShowsTheCluster: on a cluster member the console lists the
// nodes and groups with their leaders; the fencing token of a key is shown
// itself.
func TestConsoleShowsTheCluster(t *testing.T) {
	exe := browser(t)
	skipInCluster(t, "starts its own nodes")
	nodes := startNodes(t, "c", 3, func(c *server.Config) { c.AdminListen = "127.0.0.1:0"; c.InMemory, c.DataDir = true, "" })
	w := dialRaw(t, nodes[0], "console-cluster-writer", rawOpts{cleanStart: true})
	token := now()
	expectPayload(t, w.do(req{args: []string{"SET", "fenced/key", "v"}, ts: now(), ft: token}), "+OK\r\n")

	ctx, problems := openBrowser(t, exe)
	if err := chromedp.Do(ctx, chromedp.Navigate("http://"+nodes[1].AdminAddr()+"/"), chromedp.WaitVisible(`#cluster-nodes tr`), chromedp.WaitVisible(`#keys tr[data-key]`)); err != nil {
		t.Fatal(err)
	}
	text, err := chromedp.Run(ctx, chromedp.Text(`#cluster`))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"c1", "c2", "c3", "alive", "3 nodes, 4 groups"} {
		if !strings.Contains(text, want) {
			t.Fatalf("cluster panel lacks %q:\n%s", want, text)
		}
	}
	// The header says what the node is; the overview counts the
	// cluster's keys (one), labelled so, with this node's share.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := chromedp.Run(wctx, chromedp.Poll[bool](`document.getElementById("node").textContent.includes("member, leads") && document.getElementById("s-keys").textContent === "1" && document.getElementById("l-keys").textContent.startsWith("keys in the cluster")`)); err != nil {
		head, _ := chromedp.Run(ctx, chromedp.Text(`header`))
		keysLabel, _ := chromedp.Run(ctx, chromedp.Text(`#overview`))
		t.Fatalf("header %q, overview %q: want the node's role and the cluster's keys (%v)", head, keysLabel, err)
	}
	keys, err := chromedp.Run(ctx, chromedp.Text(`#keys`))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(keys, *token) {
		t.Fatalf("the key table does not show the fencing token %s:\n%s", *token, keys)
	}
	if p := problems(); len(p) > 0 {
		t.Fatalf("the page reported errors:\n%s", strings.Join(p, "\n"))
	}
}

// TestConsoleEditsKeys: the console creates a key (text, TTL), edits one
// at the version it shows, and reports a conflict instead of overwriting a
// change made meanwhile.
func TestConsoleEditsKeys(t *testing.T) {
	exe := browser(t)
	s := startServer(t, withAdmin())
	c := dialRaw(t, s, "console-editor", rawOpts{cleanStart: true})
	expectPayload(t, c.call("SET", "edit/me", "before"), "+OK\r\n")

	ctx, problems := openBrowser(t, exe)
	row := fmt.Sprintf(`#keys tr[data-key="%x"]`, "edit/me")
	if err := chromedp.Do(ctx, chromedp.Navigate("http://"+s.AdminAddr()+"/"), chromedp.WaitVisible(row)); err != nil {
		t.Fatal(err)
	}
	// A new key, with a TTL.
	for i, step := range []chromedp.Action[chromedp.Void]{
		chromedp.Click(`#new-key`), chromedp.WaitVisible(`#ed-save`),
		chromedp.SetValue(`#ed-key`, "created/by/console"),
		chromedp.SetValue(`#ed-value`, "fresh"),
		chromedp.SetValue(`#ed-ttl`, "60"),
		chromedp.Click(`#ed-save`),
	} {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := chromedp.Do(sctx, step)
		cancel()
		if err != nil {
			t.Fatalf("step %d: %v (page errors: %v)", i, err, problems())
		}
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := chromedp.Do(wctx, chromedp.WaitVisible(fmt.Sprintf(`#keys tr[data-key="%x"]`, "created/by/console"))); err != nil {
		msg, _ := chromedp.Run(ctx, chromedp.Text(`#ed-error`))
		t.Fatalf("the new key did not show: %v; editor says %q; page errors %v", err, msg, problems())
	}
	expectPayload(t, c.call("GET", "created/by/console"), "$5\r\nfresh\r\n")
	if p := string(c.call("PTTL", "created/by/console").Payload); !strings.HasPrefix(p, ":") || p == ":-1\r\n" {
		t.Fatalf("PTTL of the console's key: %q, want a positive expiry", p)
	}

	// An edit at the version shown.
	if err := chromedp.Do(ctx, chromedp.Click(row+` button.edit`), chromedp.WaitVisible(`#ed-save`), chromedp.SetValue(`#ed-value`, "after"), chromedp.Click(`#ed-save`)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the console's edit", func() bool { return string(c.call("GET", "edit/me").Payload) == "$5\r\nafter\r\n" })

	// A change meanwhile: the console says so and leaves it.
	if err := chromedp.Do(ctx, chromedp.WaitVisible(row), chromedp.Sleep(300*time.Millisecond), chromedp.Click(row+` button.edit`), chromedp.WaitVisible(`#ed-save`)); err != nil {
		t.Fatal(err)
	}
	expectPayload(t, c.call("SET", "edit/me", "sneaky"), "+OK\r\n")
	if err := chromedp.Do(ctx, chromedp.SetValue(`#ed-value`, "mine"), chromedp.Click(`#ed-save`)); err != nil {
		t.Fatal(err)
	}
	var msg string
	eventually(t, "the conflict message", func() bool {
		msg, _ = chromedp.Run(ctx, chromedp.Text(`#ed-error`))
		return strings.Contains(msg, "conflict")
	})
	expectPayload(t, c.call("GET", "edit/me"), "$6\r\nsneaky\r\n")
	// A new key that exists: refused under NX (the default); under NEX
	// only when it holds another value.
	if err := chromedp.Do(ctx, chromedp.Click(`#ed-cancel`), chromedp.Click(`#new-key`), chromedp.WaitVisible(`#ed-save`),
		chromedp.SetValue(`#ed-key`, "edit/me"), chromedp.SetValue(`#ed-value`, "other"), chromedp.Click(`#ed-save`)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the NX refusal", func() bool {
		msg, _ = chromedp.Run(ctx, chromedp.Text(`#ed-error`))
		return strings.Contains(msg, "the key exists")
	})
	if err := chromedp.Do(ctx, chromedp.SetValue(`#ed-cond`, "nex"), chromedp.SetValue(`#ed-value`, "sneaky"), chromedp.Click(`#ed-save`)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the NEX write of the same value", func() bool {
		hidden, _ := chromedp.Run(ctx, chromedp.Evaluate[bool](`document.getElementById("editor").hidden`))
		return hidden
	})
	expectPayload(t, c.call("GET", "edit/me"), "$6\r\nsneaky\r\n")

	// A value longer than the browser's preview: its editor box is left
	// empty, and a change of the expiry alone keeps the whole value
	// (before, the 4 KiB preview was saved over it).
	long := strings.Repeat("y", 5000)
	expectPayload(t, c.call("SET", "edit/long", long), "+OK\r\n")
	longRow := fmt.Sprintf(`#keys tr[data-key="%x"]`, "edit/long")
	if err := chromedp.Do(ctx, chromedp.Submit(`#filter-form`), chromedp.WaitVisible(longRow), chromedp.Click(longRow+` button.edit`), chromedp.WaitVisible(`#ed-save`)); err != nil {
		t.Fatalf("%v (page errors: %v)", err, problems())
	}
	if box, _ := chromedp.Run(ctx, chromedp.Value(`#ed-value`)); box != "" {
		t.Fatalf("the editor holds %d bytes of a 5,000-byte value", len(box))
	}
	if err := chromedp.Do(ctx, chromedp.SetValue(`#ed-ttl`, "120"), chromedp.Click(`#ed-save`)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the expiry set by the console", func() bool {
		p := string(c.call("PTTL", "edit/long").Payload)
		return strings.HasPrefix(p, ":") && p != ":-1\r\n"
	})
	expectPayload(t, c.call("GET", "edit/long"), "$5000\r\n"+long+"\r\n")
	if p := problems(); len(p) > 0 {
		t.Fatalf("the page reported errors:\n%s", strings.Join(p, "\n"))
	}
}

// TestConsoleShowsMQTT: the console lists the sessions (connected and
// offline), the busiest topics with their rates, and retained messages.
func TestConsoleShowsMQTT(t *testing.T) {
	exe := browser(t)
	s := startServer(t, withAdmin())
	sub := dialRaw(t, s, "telemetry-reader", rawOpts{cleanStart: true, noSubscribe: true})
	sub.subscribe("telemetry/#", 1)
	away := dialRaw(t, s, "gone-for-now", rawOpts{cleanStart: true, sessionExpiry: 3600, noSubscribe: true})
	away.subscribe("alerts/#", 1)
	away.c.Disconnect(&paho.Disconnect{})
	pub := dialRaw(t, s, "telemetry-writer", rawOpts{cleanStart: true, noSubscribe: true})
	pub.publish("config/retained", 1, true, "kept")

	ctx, problems := openBrowser(t, exe)
	if err := chromedp.Do(ctx, chromedp.Navigate("http://"+s.AdminAddr()+"/"), chromedp.WaitVisible(`#mqtt-clients tr`)); err != nil {
		t.Fatal(err)
	}
	var text string
	eventually(t, "the MQTT panel", func() bool {
		pub.publish("telemetry/site-1", 1, false, "21.5") // keeps a rate going
		text, _ = chromedp.Run(ctx, chromedp.Text(`#mqtt`))
		return strings.Contains(text, "telemetry/site-1") && strings.Contains(text, "offline session") && strings.Contains(text, "config/retained")
	})
	for _, want := range []string{"telemetry-reader", "gone-for-now", "connected"} {
		if !strings.Contains(text, want) {
			t.Fatalf("MQTT panel lacks %q:\n%s", want, text)
		}
	}
	if p := problems(); len(p) > 0 {
		t.Fatalf("the page reported errors:\n%s", strings.Join(p, "\n"))
	}
}
