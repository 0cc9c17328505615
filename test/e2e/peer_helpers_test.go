package e2e

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"net"
	"slices"
	"sync"
	"testing"
	"time"
)

// peer is an MQTT v5 client written out byte by byte for the publish
// path's tests: it keeps every property of a message as it came, in
// order (paho keeps one subscription identifier of several and resolves
// topic aliases out of sight), and tells what was on the wire from what
// it means.
type peer struct {
	t    testing.TB
	id   string
	conn net.Conn

	wmu    sync.Mutex
	nextID uint16

	msgs   chan inMsg     // PUBLISH packets received
	acks   chan rawPacket // PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK for this client's packets
	disc   chan rawPacket // a DISCONNECT from the server
	closed chan struct{}  // the connection ended

	aliases map[uint16]string // the server's topic aliases; the reader's
	manual  bool              // acknowledge nothing
}

// prop is one property as encoded: its identifier and value bytes.
type prop struct {
	id  byte
	val []byte
}

// inMsg is a PUBLISH as received.
type inMsg struct {
	qos          byte
	dup, retain  bool
	packetID     uint16
	topic        string // after the alias
	wireTopic    string // as sent: empty when an alias stood for it
	alias        uint16 // 0: none
	props        []prop // in the order sent, the alias's included
	payload      []byte
	receivedWhen time.Time
}

type peerOpts struct {
	clean          bool   // Clean Start
	sessionExpiry  uint32 // seconds
	topicAliasMax  uint16 // sent in CONNECT if not 0
	receiveMax     uint16 // sent in CONNECT if not 0
	maxPacketSize  uint32 // sent in CONNECT if not 0
	manualAck      bool
	sessionPresent *bool  // set to the CONNACK's flag
	willTopic      string // a will (QoS 1) if set
	willPayload    string
	willDelay      uint32 // seconds
}

// dialPeer connects a peer to addr; its CONNACK must accept it.
func dialPeer(t testing.TB, addr, id string, o peerOpts) *peer {
	t.Helper()
	conn := dialTCP(t, addr)
	var props []byte
	if o.sessionExpiry > 0 {
		props = binary.BigEndian.AppendUint32(append(props, 0x11), o.sessionExpiry)
	}
	if o.receiveMax > 0 {
		props = binary.BigEndian.AppendUint16(append(props, 0x21), o.receiveMax)
	}
	if o.topicAliasMax > 0 {
		props = binary.BigEndian.AppendUint16(append(props, 0x22), o.topicAliasMax)
	}
	if o.maxPacketSize > 0 {
		props = binary.BigEndian.AppendUint32(append(props, 0x27), o.maxPacketSize)
	}
	flags := byte(0)
	if o.clean {
		flags = 0x02
	}
	if o.willTopic != "" {
		flags |= 0x04 | 0x08 // will, QoS 1
	}
	body := append(mqttString("MQTT"), 5, flags, 0, 60)
	body = append(append(body, varint(len(props))...), props...)
	body = append(body, mqttString(id)...)
	if o.willTopic != "" {
		var wp []byte
		if o.willDelay > 0 {
			wp = binary.BigEndian.AppendUint32([]byte{0x18}, o.willDelay)
		}
		body = append(append(body, varint(len(wp))...), wp...)
		body = append(append(body, mqttString(o.willTopic)...), mqttString(o.willPayload)...)
	}
	if _, err := conn.Write(packet(0x10, body)); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(conn)
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	ack, err := readPacket(r)
	if err != nil || ack.typ != 0x20 || len(ack.body) < 3 || ack.body[1] != 0 {
		t.Fatalf("%s: CONNACK: %v %#x % x", id, err, ack.typ, ack.body)
	}
	if o.sessionPresent != nil {
		*o.sessionPresent = ack.body[0]&1 == 1
	}
	conn.SetReadDeadline(time.Time{})
	p := &peer{t: t, id: id, conn: conn, msgs: make(chan inMsg, 10000), acks: make(chan rawPacket, 100),
		disc: make(chan rawPacket, 1), closed: make(chan struct{}), aliases: map[uint16]string{}, manual: o.manualAck}
	go p.read(r)
	t.Cleanup(func() { conn.Close() })
	return p
}

func (p *peer) write(b []byte) {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	p.conn.Write(b) // a failure shows as the connection's end
}

func (p *peer) read(r *bufio.Reader) {
	defer close(p.closed)
	for {
		pk, err := readPacket(r)
		if err != nil {
			return
		}
		switch pk.typ >> 4 {
		case 3:
			m, err := decodeInMsg(pk, p.aliases)
			if err != nil {
				p.t.Errorf("%s: %v", p.id, err)
				return
			}
			if !p.manual {
				p.ack(m)
			}
			p.msgs <- m
		case 6: // PUBREL for a QoS 2 message received
			if p.manual {
				p.acks <- pk // completed by the test, or not
				continue
			}
			p.write(packet(0x70, pk.body[:2]))
		case 5: // PUBREC of the client's QoS 2 message: release it
			p.write(packet(0x62, pk.body[:2]))
			p.acks <- pk
		case 14:
			p.disc <- pk
			return
		default:
			p.acks <- pk
		}
	}
}

// ack acknowledges m (PUBACK, or PUBREC for QoS 2).
func (p *peer) ack(m inMsg) {
	switch m.qos {
	case 1:
		p.write(packet(0x40, binary.BigEndian.AppendUint16(nil, m.packetID)))
	case 2:
		p.write(packet(0x50, binary.BigEndian.AppendUint16(nil, m.packetID)))
	}
}

func decodeInMsg(pk rawPacket, aliases map[uint16]string) (inMsg, error) {
	m := inMsg{qos: pk.typ >> 1 & 3, dup: pk.typ&0x08 != 0, retain: pk.typ&1 != 0, receivedWhen: time.Now()}
	b := pk.body
	if len(b) < 2 {
		return m, fmt.Errorf("short PUBLISH % x", b)
	}
	n := int(binary.BigEndian.Uint16(b))
	if len(b) < 2+n {
		return m, fmt.Errorf("short topic in % x", b)
	}
	m.wireTopic, b = string(b[2:2+n]), b[2+n:]
	if m.qos > 0 {
		if len(b) < 2 {
			return m, fmt.Errorf("no packet id")
		}
		m.packetID, b = binary.BigEndian.Uint16(b), b[2:]
	}
	size, k := binary.Uvarint(b)
	if k <= 0 || int(size) > len(b)-k {
		return m, fmt.Errorf("bad property length")
	}
	props := b[k : k+int(size)]
	m.payload = b[k+int(size):]
	for len(props) > 0 {
		id := props[0]
		rest := props[1:]
		var l int
		switch id {
		case 0x01:
			l = 1
		case 0x23:
			l = 2
		case 0x02:
			l = 4
		case 0x03, 0x08, 0x09:
			if len(rest) < 2 {
				return m, fmt.Errorf("short property %#x", id)
			}
			l = 2 + int(binary.BigEndian.Uint16(rest))
		case 0x26:
			if len(rest) < 2 {
				return m, fmt.Errorf("short user property")
			}
			k := 2 + int(binary.BigEndian.Uint16(rest))
			if len(rest) < k+2 {
				return m, fmt.Errorf("short user property")
			}
			l = k + 2 + int(binary.BigEndian.Uint16(rest[k:]))
		case 0x0B:
			_, l = binary.Uvarint(rest)
		default:
			return m, fmt.Errorf("property %#x not allowed in a PUBLISH to a client", id)
		}
		if l <= 0 || l > len(rest) {
			return m, fmt.Errorf("short property %#x", id)
		}
		m.props = append(m.props, prop{id, rest[:l]})
		props = rest[l:]
	}
	m.topic = m.wireTopic
	if v := m.get(0x23); v != nil {
		m.alias = binary.BigEndian.Uint16(v)
		if m.alias == 0 {
			return m, fmt.Errorf("topic alias 0 from the server (MQTT-3.3.2-8)")
		}
		if m.wireTopic != "" {
			aliases[m.alias] = m.wireTopic
		} else if m.topic = aliases[m.alias]; m.topic == "" {
			return m, fmt.Errorf("alias %d used before it was set", m.alias)
		}
	} else if m.wireTopic == "" {
		return m, fmt.Errorf("PUBLISH without a topic or an alias")
	}
	return m, nil
}

// get returns the value of the message's first property id, nil if none.
func (m inMsg) get(id byte) []byte {
	for _, p := range m.props {
		if p.id == id {
			return p.val
		}
	}
	return nil
}

// user returns the user properties in order, as "key=value".
func (m inMsg) user() []string {
	var out []string
	for _, p := range m.props {
		if p.id == 0x26 {
			k := int(binary.BigEndian.Uint16(p.val))
			out = append(out, string(p.val[2:2+k])+"="+string(p.val[4+k:]))
		}
	}
	return out
}

// subIDs returns the subscription identifiers, sorted.
func (m inMsg) subIDs() []int {
	var out []int
	for _, p := range m.props {
		if p.id == 0x0B {
			v, _ := binary.Uvarint(p.val)
			out = append(out, int(v))
		}
	}
	slices.Sort(out)
	return out
}

// expiry returns the Message Expiry Interval, if the message has one.
func (m inMsg) expiry() (uint32, bool) {
	if v := m.get(0x02); v != nil {
		return binary.BigEndian.Uint32(v), true
	}
	return 0, false
}

// Property encoders for a PUBLISH.
func pFormat(b byte) prop          { return prop{0x01, []byte{b}} }
func pExpiry(s uint32) prop        { return prop{0x02, binary.BigEndian.AppendUint32(nil, s)} }
func pContentType(s string) prop   { return prop{0x03, mqttString(s)} }
func pResponseTopic(s string) prop { return prop{0x08, mqttString(s)} }
func pCorrelation(b string) prop   { return prop{0x09, mqttString(b)} }
func pAlias(a uint16) prop         { return prop{0x23, binary.BigEndian.AppendUint16(nil, a)} }
func pUser(k, v string) prop       { return prop{0x26, append(mqttString(k), mqttString(v)...)} }
func encodeProps(ps []prop) []byte {
	var b []byte
	for _, p := range ps {
		b = append(append(b, p.id), p.val...)
	}
	return append(varint(len(b)), b...)
}

// subOpt is one filter of a SUBSCRIBE with its options.
type subOpt struct {
	filter            string
	qos               byte
	noLocal, rap      bool
	retainHandling    byte
	subscriptionID    int // 0: none
	wantReason        byte
	wantReasonAtLeast bool // the SUBACK code is an error (≥ 0x80)
}

// subscribe sends one SUBSCRIBE per distinct subscription identifier (a
// SUBSCRIBE carries at most one) and checks each SUBACK grants what was
// asked: the QoS, unless wantReason says otherwise.
func (p *peer) subscribe(opts ...subOpt) {
	p.t.Helper()
	for _, o := range opts {
		p.nextID++
		id := p.nextID
		body := binary.BigEndian.AppendUint16(nil, id)
		var props []byte
		if o.subscriptionID > 0 {
			props = appendUvarint(append(props, 0x0B), o.subscriptionID)
		}
		body = append(append(body, varint(len(props))...), props...)
		flags := o.qos | o.retainHandling<<4
		if o.noLocal {
			flags |= 0x04
		}
		if o.rap {
			flags |= 0x08
		}
		body = append(append(body, mqttString(o.filter)...), flags)
		p.write(packet(0x82, body))
		ack := p.nextAck(9)
		if len(ack.body) < 4 || binary.BigEndian.Uint16(ack.body) != id {
			p.t.Fatalf("%s: SUBACK % x for packet %d", p.id, ack.body, id)
		}
		pl, k := binary.Uvarint(ack.body[2:])
		code := ack.body[2+k+int(pl)]
		want := o.qos
		if o.wantReason != 0 {
			want = o.wantReason
		}
		if o.wantReasonAtLeast && code < 0x80 || !o.wantReasonAtLeast && code != want {
			p.t.Fatalf("%s: SUBACK for %s: %#x, want %#x", p.id, o.filter, code, want)
		}
	}
}

func (p *peer) unsubscribe(filter string) {
	p.t.Helper()
	p.nextID++
	body := append(binary.BigEndian.AppendUint16(nil, p.nextID), 0)
	p.write(packet(0xA2, append(body, mqttString(filter)...)))
	p.nextAck(11)
}

func appendUvarint(b []byte, n int) []byte { return append(b, varint(n)...) }

// nextAck returns the next acknowledgement, which must be of the type.
func (p *peer) nextAck(typ byte) rawPacket {
	p.t.Helper()
	select {
	case a := <-p.acks:
		if a.typ>>4 != typ {
			p.t.Fatalf("%s: got packet type %d, want %d", p.id, a.typ>>4, typ)
		}
		return a
	case d := <-p.disc:
		p.t.Fatalf("%s: disconnected (% x) while waiting for packet type %d", p.id, d.body, typ)
	case <-time.After(10 * time.Second):
		p.t.Fatalf("%s: no packet of type %d", p.id, typ)
	}
	return rawPacket{}
}

// pubOpt is what a PUBLISH carries besides its topic and payload.
type pubOpt struct {
	qos    byte
	retain bool
	props  []prop
}

// publish sends a PUBLISH and, for QoS 1 and 2, waits for its
// acknowledgement (for QoS 2: PUBREC, PUBREL, PUBCOMP).
func (p *peer) publish(topic, payload string, o pubOpt) {
	p.t.Helper()
	var id uint16
	body := mqttString(topic)
	if o.qos > 0 {
		p.nextID++
		id = p.nextID
		body = binary.BigEndian.AppendUint16(body, id)
	}
	body = append(append(body, encodeProps(o.props)...), payload...)
	flags := o.qos << 1
	if o.retain {
		flags |= 1
	}
	p.write(packet(0x30|flags, body))
	switch o.qos {
	case 1:
		if a := p.nextAck(4); binary.BigEndian.Uint16(a.body) != id || len(a.body) > 2 && a.body[2] >= 0x80 {
			p.t.Fatalf("%s: PUBACK % x for packet %d", p.id, a.body, id)
		}
	case 2:
		if a := p.nextAck(5); binary.BigEndian.Uint16(a.body) != id || len(a.body) > 2 && a.body[2] >= 0x80 {
			p.t.Fatalf("%s: PUBREC % x for packet %d", p.id, a.body, id)
		}
		if a := p.nextAck(7); binary.BigEndian.Uint16(a.body) != id {
			p.t.Fatalf("%s: PUBCOMP % x for packet %d", p.id, a.body, id)
		}
	}
}

// expect returns the next message, which must be payload on topic.
func (p *peer) expect(topic, payload string) inMsg {
	p.t.Helper()
	select {
	case m := <-p.msgs:
		if m.topic != topic || string(m.payload) != payload {
			p.t.Fatalf("%s: got %q on %s, want %q on %s", p.id, m.payload, m.topic, payload, topic)
		}
		return m
	case <-time.After(10 * time.Second):
		p.t.Fatalf("%s: no message (want %q on %s)", p.id, payload, topic)
	}
	return inMsg{}
}

// expectNone fails if a message arrives within d.
func (p *peer) expectNone(d time.Duration, why string) {
	p.t.Helper()
	select {
	case m := <-p.msgs:
		p.t.Fatalf("%s: %s: got %q on %s", p.id, why, m.payload, m.topic)
	case <-time.After(d):
	}
}

// expectDisconnect waits for a DISCONNECT with the reason code, then the
// connection's end.
func (p *peer) expectDisconnect(reason byte) {
	p.t.Helper()
	select {
	case d := <-p.disc:
		if len(d.body) < 1 || d.body[0] != reason {
			p.t.Fatalf("%s: DISCONNECT % x, want reason %#x", p.id, d.body, reason)
		}
	case <-time.After(10 * time.Second):
		p.t.Fatalf("%s: no DISCONNECT (want %#x)", p.id, reason)
	}
	select {
	case <-p.closed:
	case <-time.After(10 * time.Second):
		p.t.Fatalf("%s: the connection stays open after DISCONNECT", p.id)
	}
}

// tryPublish sends a QoS 1 PUBLISH (dup: again, with DUP) under packet id
// id and reports whether its PUBACK came within wait: false when the
// connection ended first (its node was killed), without failing.
func (p *peer) tryPublish(topic, payload string, id uint16, dup bool, wait time.Duration) bool {
	flags := byte(0x32)
	if dup {
		flags |= 0x08
	}
	return p.tryPublishFlags(flags, topic, payload, id, wait)
}

// tryPublishRetained is tryPublish of a retained message.
func (p *peer) tryPublishRetained(topic, payload string, id uint16) bool {
	return p.tryPublishFlags(0x33, topic, payload, id, 10*time.Second)
}

func (p *peer) tryPublishFlags(flags byte, topic, payload string, id uint16, wait time.Duration) bool {
	body := binary.BigEndian.AppendUint16(mqttString(topic), id)
	body = append(append(body, 0), payload...)
	p.write(packet(flags, body))
	deadline := time.After(wait)
	for {
		select {
		case a := <-p.acks:
			if a.typ>>4 == 4 && binary.BigEndian.Uint16(a.body) == id {
				return true
			}
		case <-p.closed:
			return false
		case <-deadline:
			return false
		}
	}
}

// close ends the connection with a normal DISCONNECT.
func (p *peer) close() {
	p.write([]byte{0xE0, 0})
	p.conn.Close()
	<-p.closed
}
