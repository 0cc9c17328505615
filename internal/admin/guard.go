package admin

import (
	"net"
	"net/http"
	"strings"
)

// RequestHeader must be present on every request that changes something.
// A cross-site HTML form cannot set it, and a cross-site fetch cannot
// without a CORS preflight, which the endpoint never grants.
const RequestHeader = "X-Mqkv-Request"

// guard protects an endpoint without authentication from the web browsers
// of the people who can reach it:
//
//   - the Host header must be an IP address, localhost, or a name the
//     operator allowed; otherwise a page on any site could point its own
//     name at 127.0.0.1 and read the store through the visitor's browser
//     (DNS rebinding). Health checks and metrics, which hold no keys or
//     values, answer under any name, so that probes and scrapers can use
//     the host's DNS name without configuration;
//   - a POST must carry RequestHeader (cross-site request forgery), and
//     so must a backup: a GET, but one that copies the whole store, which
//     a cross-site page could have a visitor's browser repeat (an image
//     source) until the server runs out of memory.
type guard struct {
	next  http.Handler
	hosts map[string]bool // lower-case names allowed besides IPs and localhost
}

func newGuard(next http.Handler, allowedHosts []string) *guard {
	g := &guard{next: next, hosts: map[string]bool{}}
	for _, h := range allowedHosts {
		g.hosts[strings.ToLower(h)] = true
	}
	return g
}

// heavy are the GET paths that need RequestHeader too.
var heavy = map[string]bool{"/v1/backup": true}

// anyHost are the read-only paths served whatever the Host.
var anyHost = map[string]bool{"/healthz": true, "/readyz": true, "/metrics": true}

func (g *guard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !(anyHost[r.URL.Path] && r.Method == http.MethodGet) && !g.hostAllowed(r.Host) {
		httpError(w, http.StatusMisdirectedRequest, "host %q is not allowed: use an IP address or localhost, or add the name with --admin-allowed-hosts", r.Host)
		return
	}
	if (r.Method != http.MethodGet && r.Method != http.MethodHead || heavy[r.URL.Path]) && r.Header.Get(RequestHeader) == "" {
		httpError(w, http.StatusForbidden, "%s requests must carry the %s header", r.Method, RequestHeader)
		return
	}
	g.next.ServeHTTP(w, r)
}

func (g *guard) hostAllowed(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.ToLower(strings.TrimSuffix(strings.Trim(host, "[]"), "."))
	switch {
	case host == "":
		return false
	case net.ParseIP(host) != nil, host == "localhost", strings.HasSuffix(host, ".localhost"):
		return true
	}
	return g.hosts[host]
}
