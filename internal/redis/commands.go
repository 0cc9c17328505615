package redis

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/mqkv/mqkv/internal/gateway"
	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/resp"
)

// command is one Redis command: its handler and arity as Redis counts it
// (the name included; negative: at least that many).
type command struct {
	run   func(c *conn, args [][]byte)
	arity int
	// open: allowed before AUTH.
	open bool
	// local: a read that a node on its own answers at once, without
	// waiting for anything (see ServeLoop).
	local bool
}

var commands map[string]command

func init() {
	commands = map[string]command{
		"PING":      {run: (*conn).ping, arity: -1, open: true, local: true},
		"ECHO":      {run: (*conn).echo, arity: 2, local: true},
		"HELLO":     {run: (*conn).hello, arity: -1, open: true},
		"AUTH":      {run: (*conn).auth, arity: -2, open: true},
		"SELECT":    {run: (*conn).selectDB, arity: 2},
		"CLIENT":    {run: (*conn).client, arity: -2},
		"QUIT":      {run: (*conn).quitCmd, arity: -1, open: true},
		"INFO":      {run: (*conn).info, arity: -1},
		"DBSIZE":    {run: (*conn).dbsize, arity: 1},
		"COMMAND":   {run: func(c *conn, _ [][]byte) { c.w.array(0) }, arity: -1},
		"CONFIG":    {run: (*conn).config, arity: -2},
		"GET":       {run: (*conn).get, arity: 2, local: true},
		"SET":       {run: (*conn).set, arity: -3},
		"DEL":       {run: (*conn).del, arity: -2},
		"UNLINK":    {run: (*conn).del, arity: -2},
		"EXISTS":    {run: (*conn).exists, arity: -2, local: true},
		"MGET":      {run: (*conn).mget, arity: -2, local: true},
		"PTTL":      {run: (*conn).pttl, arity: 2, local: true},
		"TTL":       {run: (*conn).ttl, arity: 2, local: true},
		"KEYS":      {run: (*conn).keys, arity: 2},
		"SCAN":      {run: (*conn).scan, arity: -2},
		"INCR":      {run: (*conn).incr, arity: 2},
		"DECR":      {run: (*conn).incr, arity: 2},
		"INCRBY":    {run: (*conn).incr, arity: 3},
		"DECRBY":    {run: (*conn).incr, arity: 3},
		"APPEND":    {run: (*conn).appendCmd, arity: 3},
		"MQKV.GETV": {run: (*conn).getv, arity: 2, local: true},
		"MQKV.SETV": {run: (*conn).setv, arity: -3},
		"MQKV.DELV": {run: (*conn).delv, arity: -2},
	}
}

// command answers one command.
func (c *conn) command(args [][]byte) {
	cmd, ok := lookup(args[0])
	if !ok {
		c.unknown(args)
		return
	}
	if (cmd.arity > 0 && len(args) != cmd.arity) || (cmd.arity < 0 && len(args) < -cmd.arity) {
		c.w.err(fmt.Sprintf("ERR wrong number of arguments for '%s' command", strings.ToLower(string(args[0]))))
		return
	}
	if !cmd.open && !c.c.Authenticated() {
		c.w.err("NOAUTH Authentication required.")
		return
	}
	cmd.run(c, args)
}

// lookup finds a command by its name in any case, without allocating:
// names are short, upper-cased into a buffer on the stack.
func lookup(name []byte) (command, bool) {
	var buf [16]byte
	if len(name) > len(buf) {
		return command{}, false // longer than any command's name
	}
	up := buf[:len(name)]
	for i, c := range name {
		if 'a' <= c && c <= 'z' {
			c -= 'a' - 'A'
		}
		up[i] = c
	}
	cmd, ok := commands[string(up)] // looked up without a copy
	return cmd, ok
}

// unknown answers as Redis does a command it does not have.
func (c *conn) unknown(args [][]byte) {
	var b strings.Builder
	fmt.Fprintf(&b, "ERR unknown command '%s', with args beginning with: ", clip(args[0]))
	for _, a := range args[1:] {
		fmt.Fprintf(&b, "'%s' ", clip(a))
	}
	c.w.err(b.String())
}

func clip(b []byte) string {
	if len(b) > 128 {
		b = b[:128]
	}
	return string(b)
}

func (c *conn) call(args ...[]byte) (resp.Value, hlc.Timestamp) { return c.c.Call("", args...) }

func (c *conn) ping(args [][]byte) {
	switch len(args) {
	case 1:
		c.w.simple("PONG")
	case 2:
		c.w.bulk(args[1])
	default:
		c.w.err("ERR wrong number of arguments for 'ping' command")
	}
}

func (c *conn) echo(args [][]byte) { c.w.bulk(args[1]) }

func (c *conn) quitCmd([][]byte) {
	c.w.simple("OK")
	c.quit = true
}

// hello serves HELLO [protover [AUTH user pass] [SETNAME name]].
func (c *conn) hello(args [][]byte) {
	proto := c.w.proto
	i := 1
	if len(args) > 1 {
		v, err := strconv.Atoi(string(args[1]))
		if err != nil {
			c.w.err("ERR Protocol version is not an integer or out of range")
			return
		}
		if v < 2 || v > 3 {
			c.w.err("NOPROTO unsupported protocol version")
			return
		}
		proto, i = v, 2
	}
	name, setName := "", false
	for ; i < len(args); i++ {
		switch opt := strings.ToUpper(string(args[i])); {
		case opt == "AUTH" && i+2 < len(args):
			if !c.c.Auth(string(args[i+1]), args[i+2]) {
				c.w.err("WRONGPASS invalid username-password pair or user is disabled.")
				return
			}
			i += 2
		case opt == "SETNAME" && i+1 < len(args):
			name, setName = string(args[i+1]), true
			i++
		default:
			c.w.err(fmt.Sprintf("ERR Syntax error in HELLO option '%s'", clip(args[i])))
			return
		}
	}
	if !c.c.Authenticated() {
		c.w.err("NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time")
		return
	}
	if setName {
		c.name = name
	}
	c.w.proto = proto
	version := "0"
	if c.s.cfg.Info != nil {
		version = c.s.cfg.Info().Version
	}
	c.w.mapHeader(7)
	c.w.bulkString("server")
	c.w.bulkString("mqkv")
	c.w.bulkString("version")
	c.w.bulkString(version)
	c.w.bulkString("proto")
	c.w.integer(int64(proto))
	c.w.bulkString("id")
	c.w.integer(int64(c.c.Conn()))
	c.w.bulkString("mode")
	c.w.bulkString("standalone")
	c.w.bulkString("role")
	c.w.bulkString("master")
	c.w.bulkString("modules")
	c.w.array(0)
}

// auth serves AUTH [user] password.
func (c *conn) auth(args [][]byte) {
	if len(args) > 3 {
		c.w.err("ERR syntax error")
		return
	}
	if !c.s.cfg.Guard.Required() && !hasPasswords(c) {
		c.w.err("ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?")
		return
	}
	user, pass := "", args[1]
	if len(args) == 3 {
		user, pass = string(args[1]), args[2]
	}
	if !c.c.Auth(user, pass) {
		c.w.err("WRONGPASS invalid username-password pair or user is disabled.")
		return
	}
	c.w.simple("OK")
}

// hasPasswords says the node has a password file, even if it admits
// anonymous clients too.
func hasPasswords(c *conn) bool {
	p, ok := c.s.cfg.Guard.(interface{ HasPasswords() bool })
	return ok && p.HasPasswords()
}

func (c *conn) selectDB(args [][]byte) {
	if string(args[1]) != "0" {
		c.w.err("ERR DB index is out of range")
		return
	}
	c.w.simple("OK")
}

// client serves CLIENT SETNAME, GETNAME, ID, SETINFO and INFO.
func (c *conn) client(args [][]byte) {
	switch sub := strings.ToUpper(string(args[1])); {
	case sub == "SETNAME" && len(args) == 3:
		if bytes.ContainsAny(args[2], " \n") {
			c.w.err("ERR Client names cannot contain spaces, newlines or special characters.")
			return
		}
		c.name = string(args[2])
		c.w.simple("OK")
	case sub == "GETNAME" && len(args) == 2:
		if c.name == "" {
			c.w.null()
			return
		}
		c.w.bulkString(c.name)
	case sub == "ID" && len(args) == 2:
		c.w.integer(int64(c.c.Conn()))
	case sub == "SETINFO" && len(args) == 4:
		c.w.simple("OK")
	case sub == "INFO" && len(args) == 2:
		c.w.bulkString(c.clientLine())
	default:
		c.w.err(fmt.Sprintf("ERR unknown subcommand or wrong number of arguments for '%s'. Try CLIENT HELP.", clip(args[1])))
	}
}

func (c *conn) clientLine() string {
	return fmt.Sprintf("id=%d addr=%s laddr=%s name=%s age=%d db=0 user=%s resp=%d\n",
		c.c.Conn(), c.nc.RemoteAddr(), c.nc.LocalAddr(), c.name, int(time.Since(c.since).Seconds()), orDefault(c.c.User()), c.w.proto)
}

func orDefault(user string) string {
	if user == "" {
		return "default"
	}
	return user
}

// config answers CONFIG GET for what redis-benchmark and clients ask
// (save, appendonly); nothing can be set.
func (c *conn) config(args [][]byte) {
	if !strings.EqualFold(string(args[1]), "GET") || len(args) != 3 {
		c.w.err("ERR CONFIG " + strings.ToUpper(clip(args[1])) + " is not supported by mqkv")
		return
	}
	durable := c.s.cfg.Info != nil && c.s.cfg.Info().Durable
	vals := map[string]string{"save": "", "appendonly": map[bool]string{true: "yes", false: "no"}[durable], "databases": "1"}
	var pairs []string
	for k, v := range vals {
		if matchGlob(strings.ToLower(string(args[2])), k) {
			pairs = append(pairs, k, v)
		}
	}
	c.w.mapHeader(len(pairs) / 2)
	for _, p := range pairs {
		c.w.bulkString(p)
	}
}

// matchGlob matches CONFIG GET's parameter pattern (* and ? only).
func matchGlob(pattern, s string) bool {
	if pattern == "" {
		return s == ""
	}
	switch pattern[0] {
	case '*':
		for i := 0; i <= len(s); i++ {
			if matchGlob(pattern[1:], s[i:]) {
				return true
			}
		}
		return false
	case '?':
		return s != "" && matchGlob(pattern[1:], s[1:])
	default:
		return s != "" && s[0] == pattern[0] && matchGlob(pattern[1:], s[1:])
	}
}

func (c *conn) get(args [][]byte) {
	c.getArgs = [2][]byte{verbGET, args[1]} // read at once: reused
	start := len(c.w.b)
	c.w.b, _ = c.c.AppendCall(c.w.b, "", c.getArgs[:]...)
	c.getArgs[1] = nil // the key is not kept past the call
	if p := c.w.b[start:]; !(len(p) > 1 && p[0] == '$' && p[1] != '-') {
		// Not a value (the same bytes in RESP2 and RESP3): a nil, which
		// RESP3 writes its own way, or an error, in Redis's words.
		p = bytes.Clone(p)
		c.w.b = c.w.b[:start]
		c.w.value(gateway.Parse(p))
	}
}

// set serves SET key value [NX|XX] [GET] [EX s|PX ms|EXAT t|PXAT t] when
// it must run on its own (XX, NX with GET); the others go through
// startWrite.
func (c *conn) set(args [][]byte) {
	cmd, errText := setCommand(nil, args)
	if errText != "" {
		c.w.err(errText)
		return
	}
	if has(args[3:], "XX") {
		cmd = append(cmd, optXX)
	}
	v, _ := c.call(cmd...)
	if v.Kind == resp.ErrorReply && string(v.Str) == string(resp.ErrValueOpsProtocol) {
		// A cluster not yet at the protocol of SET ... XX: on condition
		// of the version read, as before it.
		c.setIfExists(cmd[:len(cmd)-1])
		return
	}
	if v.Kind == resp.Integer && v.Int == -1 && has(args[3:], "GET") && !has(args[3:], "XX") {
		c.get(args[:2]) // SET NX GET not applied answers with the value held
		return
	}
	setReply(&c.w, v)
}

func has(opts [][]byte, name string) bool {
	for _, o := range opts {
		if strings.EqualFold(string(o), name) {
			return true
		}
	}
	return false
}

// setCommand turns Redis's SET into the store's (NX, PX, GET kept; EX,
// EXAT and PXAT made PX; XX left to the caller), appended to dst (room
// for 7), or says what is wrong with it.
func setCommand(dst, args [][]byte) (cmd [][]byte, errText string) {
	var nx, xx, get, haveTTL bool
	var px int64
	for i := 3; i < len(args); i++ {
		opt := strings.ToUpper(string(args[i]))
		switch {
		case opt == "NX" && !xx:
			nx = true
		case opt == "XX" && !nx:
			xx = true
		case opt == "GET":
			get = true
		case (opt == "EX" || opt == "PX" || opt == "EXAT" || opt == "PXAT") && !haveTTL && i+1 < len(args):
			n, err := strconv.ParseInt(string(args[i+1]), 10, 64)
			if err != nil {
				return nil, "ERR value is not an integer or out of range"
			}
			if n <= 0 || (opt == "EX" || opt == "EXAT") && n > 1<<53/1000 || n > 1<<53 {
				return nil, "ERR invalid expire time in 'set' command"
			}
			switch opt {
			case "EX":
				px = n * 1000
			case "PX":
				px = n
			case "EXAT":
				px = n*1000 - time.Now().UnixMilli()
			case "PXAT":
				px = n - time.Now().UnixMilli()
			}
			px = max(px, 1) // a moment in the past: gone at once
			haveTTL = true
			i++
		case opt == "KEEPTTL":
			return nil, "ERR KEEPTTL is not supported by mqkv: a SET gives the key the expiry it names, or none"
		default:
			return nil, "ERR syntax error"
		}
	}
	cmd = append(dst, verbSET, args[1], args[2])
	if nx {
		cmd = append(cmd, optNX)
	}
	if haveTTL {
		cmd = append(cmd, optPX, strconv.AppendInt(nil, px, 10))
	}
	if get {
		cmd = append(cmd, verbGET)
	}
	return cmd, ""
}

// The words of the commands the endpoint sends on, shared by all: the
// service reads its arguments and never writes them.
var verbSET, verbGET, verbDEL, optNX, optXX, optPX = []byte("SET"), []byte("GET"), []byte("DEL"), []byte("NX"), []byte("XX"), []byte("PX")

// setReply writes the store's answer to a SET as Redis gives it: a
// condition not met is a null.
func setReply(w *writer, v resp.Value) {
	if v.Kind == resp.Integer && v.Int == -1 {
		w.null()
		return
	}
	w.value(v)
}

// setIfExists serves SET ... XX in a cluster below the protocol of the
// store's own (store.IfExists, which the log applies to whatever the key
// holds then): the key is set on condition that it still holds the
// version read (gateway.SetIfUnchanged), tried again if it changed.
func (c *conn) setIfExists(cmd [][]byte) {
	v, found := c.c.SetIfUnchanged("", cmd[1], func([]byte) ([]byte, [][]byte) { return cmd[2], cmd[3:] })
	if !found {
		c.w.null() // nothing to replace: not set (GET: the nil it holds)
		return
	}
	c.w.value(v)
}

// appendCmd serves APPEND key value: the store's APPEND, which the log
// applies to whatever the key holds then (concurrent ones all take
// effect), answered with the value's length after, as Redis's.
func (c *conn) appendCmd(args [][]byte) {
	v, _ := c.call(verbAPPEND, args[1], args[2])
	c.w.value(v)
}

var verbAPPEND = []byte("APPEND")

// del serves DEL and UNLINK: one write per key (not one atomic write).
func (c *conn) del(args [][]byte) {
	var n int64
	for _, k := range args[1:] {
		v, _ := c.call([]byte("DEL"), k)
		if v.Kind == resp.ErrorReply {
			c.w.value(v)
			return
		}
		if v.Int == 1 {
			n++
		}
	}
	c.w.integer(n)
}

// incr serves INCR, DECR, INCRBY and DECRBY where they are not in flight
// with other writes (asyncWrite): as the store's INCRBY and DECRBY, which
// the log applies to whatever the key holds then, Redis's atomic counter,
// concurrent increments each counted.
func (c *conn) incr(args [][]byte) {
	verb, delta := counter(args)
	v, _ := c.call(verb, args[1], delta)
	c.w.value(v)
}

// counter says what the store is sent for args if it is INCR k, DECR k,
// INCRBY k n or DECRBY k n: its verb (nil for anything else) and delta.
func counter(args [][]byte) (verb, delta []byte) {
	switch name := string(args[0]); {
	case len(args) == 2 && strings.EqualFold(name, "INCR"):
		return verbINCRBY, one
	case len(args) == 2 && strings.EqualFold(name, "DECR"):
		return verbDECRBY, one
	case len(args) == 3 && strings.EqualFold(name, "INCRBY"):
		return verbINCRBY, args[2]
	case len(args) == 3 && strings.EqualFold(name, "DECRBY"):
		return verbDECRBY, args[2]
	}
	return nil, nil
}

var verbINCRBY, verbDECRBY, one = []byte("INCRBY"), []byte("DECRBY"), []byte("1")

func (c *conn) exists(args [][]byte) {
	var n int64
	for _, k := range args[1:] {
		v, _ := c.call([]byte("PTTL"), k)
		if v.Kind == resp.ErrorReply {
			c.w.value(v)
			return
		}
		if v.Int != -2 {
			n++
		}
	}
	c.w.integer(n)
}

func (c *conn) mget(args [][]byte) {
	vals := make([]resp.Value, 0, len(args)-1)
	for _, k := range args[1:] {
		v, _ := c.call([]byte("GET"), k)
		if v.Kind == resp.ErrorReply {
			c.w.value(v)
			return
		}
		vals = append(vals, v)
	}
	c.w.array(len(vals))
	for _, v := range vals {
		c.w.value(v)
	}
}

func (c *conn) pttl(args [][]byte) {
	v, _ := c.call([]byte("PTTL"), args[1])
	c.w.value(v)
}

func (c *conn) ttl(args [][]byte) {
	v, _ := c.call([]byte("PTTL"), args[1])
	if v.Kind == resp.Integer && v.Int > 0 {
		v.Int = (v.Int + 500) / 1000
	}
	c.w.value(v)
}

// keysLimit bounds KEYS: past it the client is told to use SCAN.
const keysLimit = 100_000

func (c *conn) keys(args [][]byte) {
	var all [][]byte
	var token []byte
	for {
		keys, next, errv := c.scanPage(args[1], token, 10_000)
		if errv != nil {
			c.w.value(*errv)
			return
		}
		all = append(all, keys...)
		if len(all) > keysLimit {
			c.w.err(fmt.Sprintf("ERR KEYS matched more than %d keys; use SCAN", keysLimit))
			return
		}
		if next == nil {
			break
		}
		token = next
	}
	c.w.array(len(all))
	for _, k := range all {
		c.w.bulk(k)
	}
}

// scanPage reads one page of the service's SCAN: keys matching pattern
// after token (nil: from the start), and the token to go on (nil: done).
func (c *conn) scanPage(pattern, token []byte, count int) (keys [][]byte, next []byte, errv *resp.Value) {
	cmd := [][]byte{[]byte("SCAN"), pattern}
	if token != nil {
		cmd = append(cmd, token)
	}
	cmd = append(cmd, []byte("COUNT"), strconv.AppendInt(nil, int64(count), 10))
	v, _ := c.call(cmd...)
	if v.Kind == resp.ErrorReply {
		return nil, nil, &v
	}
	if v.Kind != resp.Array || len(v.Elems) == 0 {
		e := resp.Value{Kind: resp.ErrorReply, Str: []byte("unexpected SCAN reply")}
		return nil, nil, &e
	}
	for _, k := range v.Elems[0].Elems {
		keys = append(keys, k.Str)
	}
	if len(v.Elems) == 2 {
		next = v.Elems[1].Str
	}
	return keys, next, nil
}

// scan serves SCAN cursor [MATCH pattern] [COUNT n] [TYPE string]. Redis
// cursors are numbers; the service's continuation tokens are not, so a
// connection keeps the tokens of its recent cursors (see cursors): a
// cursor is good on the connection that got it.
func (c *conn) scan(args [][]byte) {
	cur, err := strconv.ParseUint(string(args[1]), 10, 64)
	if err != nil {
		c.w.err("ERR invalid cursor")
		return
	}
	pattern, count, typeOK := []byte("*"), 10, true
	for i := 2; i < len(args); i++ {
		opt := strings.ToUpper(string(args[i]))
		if i+1 >= len(args) {
			c.w.err("ERR syntax error")
			return
		}
		switch opt {
		case "MATCH":
			pattern = args[i+1]
		case "COUNT":
			n, err := strconv.Atoi(string(args[i+1]))
			if err != nil {
				c.w.err("ERR value is not an integer or out of range")
				return
			}
			if n < 1 {
				c.w.err("ERR syntax error")
				return
			}
			count = n
		case "TYPE":
			typeOK = strings.EqualFold(string(args[i+1]), "string")
		default:
			c.w.err("ERR syntax error")
			return
		}
		i++
	}
	var token []byte
	if cur != 0 {
		var ok bool
		if token, ok = c.cursor.take(cur); !ok {
			c.w.err("ERR invalid cursor")
			return
		}
	}
	keys, next, errv := c.scanPage(pattern, token, count)
	if errv != nil {
		c.w.value(*errv)
		return
	}
	var nextCur uint64
	if next != nil {
		nextCur = c.cursor.put(next)
	}
	if !typeOK {
		keys = nil
	}
	c.w.array(2)
	c.w.bulkString(strconv.FormatUint(nextCur, 10))
	c.w.array(len(keys))
	for _, k := range keys {
		c.w.bulk(k)
	}
}

// cursors maps a connection's SCAN cursors to the service's tokens; it
// keeps the most recent few, so a client that abandons scans holds no
// more.
type cursors struct {
	next  uint64
	order []uint64
	tok   map[uint64][]byte
}

const maxCursors = 64

func (cs *cursors) put(token []byte) uint64 {
	if cs.tok == nil {
		cs.tok = map[uint64][]byte{}
	}
	cs.next++
	id := cs.next
	cs.tok[id] = token
	cs.order = append(cs.order, id)
	if len(cs.order) > maxCursors {
		delete(cs.tok, cs.order[0])
		cs.order = cs.order[1:]
	}
	return id
}

func (cs *cursors) take(id uint64) ([]byte, bool) {
	t, ok := cs.tok[id]
	return t, ok
}

func (c *conn) dbsize([][]byte) {
	var n int
	if c.s.cfg.Info != nil {
		n = c.s.cfg.Info().Keys
	}
	c.w.integer(int64(n))
}

// info serves INFO [section ...]: server, clients, keyspace (the default
// and "all" give all three).
func (c *conn) info(args [][]byte) {
	want := map[string]bool{}
	for _, a := range args[1:] {
		want[strings.ToLower(string(a))] = true
	}
	all := len(want) == 0 || want["all"] || want["default"] || want["everything"]
	var in Info
	if c.s.cfg.Info != nil {
		in = c.s.cfg.Info()
	}
	var b strings.Builder
	if all || want["server"] {
		mode := "in-memory"
		if in.Durable {
			mode = "durable"
		}
		fmt.Fprintf(&b, "# Server\r\nredis_version:7.2.0\r\nmqkv_version:%s\r\nmqkv_node:%s\r\nmqkv_mode:%s\r\nredis_mode:standalone\r\narch_bits:64\r\ntcp_port:%s\r\nuptime_in_seconds:%d\r\n\r\n",
			in.Version, in.NodeID, mode, port(c.nc.LocalAddr().String()), int(time.Since(in.Started).Seconds()))
	}
	if all || want["clients"] {
		fmt.Fprintf(&b, "# Clients\r\nconnected_clients:%d\r\ntotal_connections_received:%d\r\n\r\n", c.s.Connected.Load(), c.s.Total.Load())
	}
	if all || want["keyspace"] {
		b.WriteString("# Keyspace\r\n")
		if in.Keys > 0 {
			fmt.Fprintf(&b, "db0:keys=%d,expires=0,avg_ttl=0\r\nmqkv_bytes:%d\r\n", in.Keys, in.Bytes)
		}
		if in.Partial {
			b.WriteString("mqkv_partial:1\r\n")
		}
		b.WriteString("\r\n")
	}
	if c.w.proto >= 3 {
		c.w.line('=', strconv.Itoa(len(b.String())+4)) // verbatim string: "txt:" and the text
		c.w.str("txt:")
		c.w.str(b.String())
		c.w.str("\r\n")
		return
	}
	c.w.bulkString(b.String())
}

func port(addr string) string {
	if i := strings.LastIndexByte(addr, ':'); i >= 0 {
		return addr[i+1:]
	}
	return addr
}

// getv serves MQKV.GETV key: [value, version], or a null.
func (c *conn) getv(args [][]byte) {
	v, ver := c.call([]byte("GET"), args[1])
	if v.Kind != resp.BulkString || v.Null {
		c.w.value(v)
		return
	}
	c.w.array(2)
	c.w.bulk(v.Str)
	c.w.bulkString(ver.String())
}

// setv serves MQKV.SETV key value [NX | NEX | VER v] [PX ms] [FENCE t]:
// the new version, or a null if the condition did not hold.
func (c *conn) setv(args [][]byte) {
	cmd, fence, ok := c.versioned([][]byte{[]byte("SET"), args[1], args[2]}, args[3:], map[string]bool{"NX": false, "NEX": false, "VER": true, "PX": true})
	if !ok {
		return
	}
	v, ver := c.c.Call(fence, cmd...)
	switch {
	case v.Kind == resp.Integer && v.Int == -1:
		c.w.null()
	case v.Kind == resp.ErrorReply:
		c.w.value(v)
	default:
		c.w.bulkString(ver.String())
	}
}

// delv serves MQKV.DELV key [VER v] [FENCE t]: 1 deleted, 0 absent, -1
// another version held.
func (c *conn) delv(args [][]byte) {
	cmd, fence, ok := c.versioned([][]byte{[]byte("DEL"), args[1]}, args[2:], map[string]bool{"VER": true})
	if !ok {
		return
	}
	v, _ := c.c.Call(fence, cmd...)
	c.w.value(v)
}

// versioned adds the options of an MQKV.* write to cmd: opts names the
// ones allowed (true: with an argument); FENCE is taken apart.
func (c *conn) versioned(cmd, rest [][]byte, opts map[string]bool) ([][]byte, string, bool) {
	fence := ""
	for i := 0; i < len(rest); i++ {
		opt := strings.ToUpper(string(rest[i]))
		if opt == "FENCE" && i+1 < len(rest) {
			fence = string(rest[i+1])
			i++
			continue
		}
		withArg, known := opts[opt]
		if !known || (withArg && i+1 >= len(rest)) {
			c.w.err("ERR syntax error")
			return nil, "", false
		}
		cmd = append(cmd, []byte(opt))
		if withArg {
			cmd = append(cmd, rest[i+1])
			i++
		}
	}
	return cmd, fence, true
}
