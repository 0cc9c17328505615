package e2e

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mqkv/mqkv/internal/server"
)

// Every option and property the publish path handles, with publishers
// and subscribers as separate clients, checked on the bytes each
// subscriber receives. Each case runs with QoS 0 and 1 messages, which
// the publisher's reader writes to the subscribers itself, and QoS 2 or
// retained ones, which mochi routes (internal/broker/direct.go): a
// change to either path is seen.

// eachTopology runs test with publishers and subscribers on one node, and
// on two nodes of a three-node cluster (pub on the first, sub on the
// second), side by side.
func eachTopology(t *testing.T, test func(t *testing.T, pub, sub string)) {
	t.Run("one node", func(t *testing.T) {
		t.Parallel()
		s := startServer(t, inMemory())
		test(t, s.Addr(), s.Addr())
	})
	t.Run("across nodes", func(t *testing.T) {
		t.Parallel()
		nodes := sharedCluster(t)
		test(t, nodes[0].Addr(), nodes[1].Addr())
	})
}

// sharedCluster is a three-node cluster (in memory) the tests of
// messages across nodes share, each with client ids and topics of its
// own: one cluster for all of them costs a few seconds once instead of
// each. It runs until the test binary ends.
func sharedCluster(t *testing.T) []*server.Server {
	t.Helper()
	sharedOnce.Do(func() {
		var join []string
		for i := range 3 {
			s, err := server.Start(server.Config{Listen: "127.0.0.1:0", InMemory: true, Logger: quietLogger(),
				Cluster: server.ClusterConfig{NodeID: fmt.Sprint("shared", i+1), Listen: "127.0.0.1:0", Join: join, Groups: 4}})
			if err != nil {
				sharedErr = err
				return
			}
			sharedNodes = append(sharedNodes, s)
			join = []string{sharedNodes[0].ClusterAddr()}
		}
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	awaitSettled(t, sharedNodes[0])
	return sharedNodes
}

var (
	sharedOnce  sync.Once
	sharedNodes []*server.Server
	sharedErr   error
)

// publishes are the ways a message is published in these tests: the
// QoS, and whether it is retained.
var publishes = []pubOpt{{qos: 0}, {qos: 1}, {qos: 2}, {qos: 1, retain: true}}

func pubName(o pubOpt) string {
	if o.retain {
		return fmt.Sprintf("qos%d-retained", o.qos)
	}
	return fmt.Sprintf("qos%d", o.qos)
}

// clearRetained removes the retained message of topic, if any.
func clearRetained(c *peer, topic string) { c.publish(topic, "", pubOpt{qos: 1, retain: true}) }

// MQTT-3.8.3-3: No Local keeps a message only from the client that
// published it, and only on account of the subscription that has it.
func TestPubSubNoLocal(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		for _, o := range publishes {
			t.Run(pubName(o), func(t *testing.T) {
				topic := "nl/" + pubName(o) + "/t"
				a := dialPeer(t, pubAddr, "nl-a-"+pubName(o), peerOpts{clean: true})
				b := dialPeer(t, subAddr, "nl-b-"+pubName(o), peerOpts{clean: true})
				c := dialPeer(t, subAddr, "nl-c-"+pubName(o), peerOpts{clean: true})
				a.subscribe(subOpt{filter: topic, qos: 2, noLocal: true})
				b.subscribe(subOpt{filter: topic, qos: 2, noLocal: true})
				c.subscribe(subOpt{filter: "nl/" + pubName(o) + "/#", qos: 2})
				a.publish(topic, "from-a", o)
				b.expect(topic, "from-a")
				c.expect(topic, "from-a")
				b.publish(topic, "from-b", o)
				a.expect(topic, "from-b")
				c.expect(topic, "from-b")
				a.expectNone(200*time.Millisecond, "its own message under No Local")
				b.expectNone(0, "its own message under No Local")
				c.expectNone(0, "a second copy")
				if o.retain {
					clearRetained(c, topic)
				}
			})
		}
	})
}

// A client's overlapping subscriptions, of which only some have No
// Local: its own message reaches it through the others, once; a topic
// only No Local subscriptions of its own match does not.
func TestPubSubNoLocalOverlapping(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		for _, o := range publishes {
			t.Run(pubName(o), func(t *testing.T) {
				prefix := "ov/" + pubName(o)
				d := dialPeer(t, pubAddr, "ov-d-"+pubName(o), peerOpts{clean: true})
				e := dialPeer(t, subAddr, "ov-e-"+pubName(o), peerOpts{clean: true})
				d.subscribe(subOpt{filter: prefix + "/#", qos: 2, noLocal: true, subscriptionID: 1},
					subOpt{filter: prefix + "/x", qos: 2, subscriptionID: 2})
				e.subscribe(subOpt{filter: prefix + "/#", qos: 2})
				d.publish(prefix+"/x", "both", o)
				m := d.expect(prefix+"/x", "both")
				if ids := m.subIDs(); !slices.Equal(ids, []int{1, 2}) {
					t.Fatalf("own message: subscription identifiers %v, want [1 2]", ids)
				}
				d.publish(prefix+"/y", "no-local-only", o)
				e.expect(prefix+"/x", "both")
				e.expect(prefix+"/y", "no-local-only")
				d.expectNone(200*time.Millisecond, "a second copy, or its own message on a No Local subscription alone")
				if o.retain {
					clearRetained(e, prefix+"/x")
					clearRetained(e, prefix+"/y")
				}
			})
		}
	})
}

// MQTT-3.3.1-12, -13: Retain As Published keeps a live message's retain
// flag; without it the flag is cleared. A message not retained never
// carries it.
func TestPubSubRetainAsPublished(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		for _, qos := range []byte{0, 1, 2} {
			t.Run(fmt.Sprint("qos", qos), func(t *testing.T) {
				topic := fmt.Sprintf("rap/%d/t", qos)
				keep := dialPeer(t, subAddr, fmt.Sprint("rap-keep-", qos), peerOpts{clean: true})
				clear := dialPeer(t, subAddr, fmt.Sprint("rap-clear-", qos), peerOpts{clean: true})
				pub := dialPeer(t, pubAddr, fmt.Sprint("rap-pub-", qos), peerOpts{clean: true})
				keep.subscribe(subOpt{filter: topic, qos: 2, rap: true})
				clear.subscribe(subOpt{filter: topic, qos: 2})
				pub.publish(topic, "retained", pubOpt{qos: qos, retain: true})
				pub.publish(topic, "live", pubOpt{qos: qos})
				if m := keep.expect(topic, "retained"); !m.retain {
					t.Fatal("MQTT-3.3.1-13: Retain As Published lost the retain flag")
				}
				if m := clear.expect(topic, "retained"); m.retain {
					t.Fatal("MQTT-3.3.1-12: retain flag kept without Retain As Published")
				}
				for _, c := range []*peer{keep, clear} {
					if m := c.expect(topic, "live"); m.retain {
						t.Fatalf("%s: a message not retained arrived with the retain flag", c.id)
					}
				}
				clearRetained(pub, topic)
			})
		}
	})
}

// MQTT-3.3.1-9, -10, -11: Retain Handling 0 sends the retained message
// at every SUBSCRIBE, 1 only for a new subscription, 2 never; with the
// retain flag set (MQTT-3.3.1-9: whatever Retain As Published says).
func TestPubSubRetainHandling(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		pub := dialPeer(t, pubAddr, "rh-pub", peerOpts{clean: true})
		pub.publish("rh/t", "kept", pubOpt{qos: 1, retain: true})
		for _, tc := range []struct {
			handling     byte
			first, again bool
		}{{0, true, true}, {1, true, false}, {2, false, false}} {
			c := dialPeer(t, subAddr, fmt.Sprint("rh-", tc.handling), peerOpts{clean: true})
			for i, want := range []bool{tc.first, tc.again} {
				c.subscribe(subOpt{filter: "rh/#", qos: 1, retainHandling: tc.handling})
				if want {
					if m := c.expect("rh/t", "kept"); !m.retain || m.qos != 1 {
						t.Fatalf("handling %d: retained message with retain %v, QoS %d", tc.handling, m.retain, m.qos)
					}
				} else {
					c.expectNone(200*time.Millisecond, fmt.Sprintf("Retain Handling %d, SUBSCRIBE #%d", tc.handling, i+1))
				}
			}
		}
		clearRetained(pub, "rh/t")
		late := dialPeer(t, subAddr, "rh-late", peerOpts{clean: true})
		late.subscribe(subOpt{filter: "rh/#", qos: 1})
		late.expectNone(200*time.Millisecond, "a retained message cleared by an empty retained PUBLISH")
	})
}

// MQTT-3.3.4-3, -4: a message matching several subscriptions of a client
// is sent once, with the identifiers of all that have one, at the highest
// of their QoS (MQTT-3.3.4-2); a client that gave none gets none.
func TestPubSubSubscriptionIdentifiers(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		for _, o := range publishes {
			t.Run(pubName(o), func(t *testing.T) {
				p := "sid/" + pubName(o)
				s := dialPeer(t, subAddr, "sid-s-"+pubName(o), peerOpts{clean: true})
				s.subscribe(subOpt{filter: p + "/#", qos: 0, subscriptionID: 1},
					subOpt{filter: p + "/+/x", qos: 1, subscriptionID: 2},
					subOpt{filter: p + "/a/x", qos: 0},
					subOpt{filter: "+/" + pubName(o) + "/a/x", qos: 2, subscriptionID: 268435455})
				none := dialPeer(t, subAddr, "sid-none-"+pubName(o), peerOpts{clean: true})
				none.subscribe(subOpt{filter: p + "/#", qos: 2})
				pub := dialPeer(t, pubAddr, "sid-pub-"+pubName(o), peerOpts{clean: true})
				pub.publish(p+"/a/x", "all", o)
				pub.publish(p+"/b/y", "one", o)
				m := s.expect(p+"/a/x", "all")
				if ids := m.subIDs(); !slices.Equal(ids, []int{1, 2, 268435455}) {
					t.Fatalf("identifiers %v, want [1 2 268435455]", ids)
				}
				if m.qos != o.qos {
					t.Fatalf("QoS %d, want %d (the highest of the matching subscriptions')", m.qos, o.qos)
				}
				m = s.expect(p+"/b/y", "one")
				if ids := m.subIDs(); !slices.Equal(ids, []int{1}) || m.qos != 0 {
					t.Fatalf("identifiers %v at QoS %d, want [1] at QoS 0", ids, m.qos)
				}
				for _, topic := range []string{p + "/a/x", p + "/b/y"} {
					if m := none.expect(topic, map[bool]string{true: "all", false: "one"}[topic == p+"/a/x"]); m.subIDs() != nil {
						t.Fatalf("identifiers %v on subscriptions made without one", m.subIDs())
					}
				}
				s.expectNone(200*time.Millisecond, "a second copy")
				if o.retain {
					clearRetained(pub, p+"/a/x")
					clearRetained(pub, p+"/b/y")
				}
			})
		}
	})
}

// QoS is the lower of the message's and the subscription's
// (MQTT-3.8.4-8), per subscriber.
func TestPubSubQoSDowngrade(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		var subs [3]*peer
		for q := range subs {
			subs[q] = dialPeer(t, subAddr, fmt.Sprint("qd-", q), peerOpts{clean: true})
			subs[q].subscribe(subOpt{filter: "qd/#", qos: byte(q)})
		}
		pub := dialPeer(t, pubAddr, "qd-pub", peerOpts{clean: true})
		for _, o := range publishes {
			topic := "qd/" + pubName(o)
			pub.publish(topic, "m", o)
			for q, s := range subs {
				if m := s.expect(topic, "m"); m.qos != min(o.qos, byte(q)) || m.retain {
					t.Fatalf("%s to a QoS %d subscription: QoS %d retain %v, want QoS %d", pubName(o), q, m.qos, m.retain, min(o.qos, byte(q)))
				}
			}
			if o.retain {
				clearRetained(pub, topic)
			}
		}
	})
}

// Payload Format Indicator, Content Type, Response Topic, Correlation
// Data and user properties (in order, repeated keys kept) reach every
// subscriber unchanged (MQTT-3.3.2-4, -15, -16, -17, 3.3.2.3.7).
func TestPubSubPropertiesPassThrough(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		props := []prop{pFormat(1), pContentType("application/json; charset=utf-8"), pResponseTopic("replies/for/me"),
			pCorrelation("\x00\x01corr\xff"), pUser("k", "1"), pUser("z", ""), pUser("k", "2"), pUser("", "empty key")}
		wantUser := []string{"k=1", "z=", "k=2", "=empty key"}
		subs := []*peer{dialPeer(t, subAddr, "pp-1", peerOpts{clean: true}), dialPeer(t, subAddr, "pp-2", peerOpts{clean: true})}
		for _, s := range subs {
			s.subscribe(subOpt{filter: "pp/#", qos: 2})
		}
		pub := dialPeer(t, pubAddr, "pp-pub", peerOpts{clean: true})
		for _, o := range publishes {
			topic := "pp/" + pubName(o)
			o.props = props
			pub.publish(topic, `{"v":1}`, o)
			for _, s := range subs {
				m := s.expect(topic, `{"v":1}`)
				check := func(id byte, want prop) {
					if got := m.get(id); string(got) != string(want.val) {
						t.Fatalf("%s %s: property %#x = % x, want % x", s.id, pubName(o), id, got, want.val)
					}
				}
				check(0x01, props[0])
				check(0x03, props[1])
				check(0x08, props[2])
				check(0x09, props[3])
				if u := m.user(); !slices.Equal(u, wantUser) {
					t.Fatalf("%s %s: user properties %q, want %q", s.id, pubName(o), u, wantUser)
				}
				if _, ok := m.expiry(); ok {
					t.Fatalf("%s: a message expiry the publisher did not set", s.id)
				}
			}
			if o.retain {
				clearRetained(pub, topic)
			}
		}
	})
}

// MQTT-3.3.2-6: a message's expiry interval reaches a subscriber less the
// time it waited; one that expires while its subscriber is away is not
// delivered (MQTT-3.3.2-5).
func TestPubSubMessageExpiry(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		live := dialPeer(t, subAddr, "exp-live", peerOpts{clean: true})
		live.subscribe(subOpt{filter: "exp/#", qos: 2})
		away := dialPeer(t, subAddr, "exp-away", peerOpts{clean: true, sessionExpiry: 300})
		away.subscribe(subOpt{filter: "exp/#", qos: 1})
		away.close()
		pub := dialPeer(t, pubAddr, "exp-pub", peerOpts{clean: true})
		for _, o := range publishes {
			topic := "exp/" + pubName(o)
			o.props = []prop{pExpiry(60)}
			pub.publish(topic, "60s", o)
			m := live.expect(topic, "60s")
			if e, ok := m.expiry(); !ok || e > 60 || e < 58 {
				t.Fatalf("%s: expiry %d (%v), want about 60", pubName(o), e, ok)
			}
			if o.retain {
				clearRetained(pub, topic)
				live.expect(topic, "")
			}
		}
		pub.publish("exp/short", "1s", pubOpt{qos: 1, props: []prop{pExpiry(1)}})
		pub.publish("exp/long", "60s", pubOpt{qos: 1, props: []prop{pExpiry(60)}})
		time.Sleep(2100 * time.Millisecond) // the short one expires; a second and more pass
		var present bool
		back := dialPeer(t, subAddr, "exp-away", peerOpts{sessionExpiry: 300, sessionPresent: &present})
		if !present {
			t.Fatal("the session is gone")
		}
		for _, o := range publishes {
			if o.qos > 0 {
				back.expect("exp/"+pubName(o), "60s") // QoS 0 is not queued for an absent client
			}
			if o.retain {
				back.expect("exp/"+pubName(o), "") // cleared
			}
		}
		m := back.expect("exp/long", "60s")
		if e, ok := m.expiry(); !ok || e > 58 {
			t.Fatalf("held 2 s: expiry %d (%v), want at most 58", e, ok)
		}
		back.expectNone(200*time.Millisecond, "the expired message")
	})
}

// Topic aliases from the client (MQTT-3.3.2-8, -9, -12): a valid one
// stands for its topic for every subscriber; 0, or one above the Topic
// Alias Maximum of the CONNACK, ends the connection with 0x94.
func TestPubSubInboundTopicAliases(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		sub := dialPeer(t, subAddr, "ia-sub", peerOpts{clean: true})
		sub.subscribe(subOpt{filter: "ia/#", qos: 2})
		pub := dialPeer(t, pubAddr, "ia-pub", peerOpts{clean: true})
		for _, o := range publishes {
			topic := "ia/long/topic/" + pubName(o)
			o.props = []prop{pAlias(7), pUser("n", "1")}
			pub.publish(topic, "set", o)
			pub.publish("", "used", o)
			for _, payload := range []string{"set", "used"} {
				if m := sub.expect(topic, payload); m.user()[0] != "n=1" || m.get(0x23) != nil {
					t.Fatalf("%s: the client's alias passed on, or properties lost: %+v", pubName(o), m.props)
				}
			}
			if o.retain {
				clearRetained(pub, topic)
				sub.expect(topic, "")
			}
		}
		for _, alias := range []uint16{0, 65, 65535} {
			bad := dialPeer(t, pubAddr, fmt.Sprint("ia-bad-", alias), peerOpts{clean: true})
			bad.write(packet(0x30, append(append(mqttString("ia/bad"), encodeProps([]prop{pAlias(alias)})...), "bad"...)))
			bad.expectDisconnect(0x94)
		}
		sub.expectNone(200*time.Millisecond, "a message with an invalid alias")
	})
}

// Topic aliases to a client that takes them (Topic Alias Maximum in its
// CONNECT): a topic's first message sets one, later ones use it, a topic
// past the maximum comes whole, as do messages to a client that takes
// none, and every message resent on the next connection.
func TestPubSubOutboundTopicAliases(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		for _, o := range publishes {
			t.Run(pubName(o), func(t *testing.T) {
				p := "oa/" + pubName(o)
				aliasing := dialPeer(t, subAddr, "oa-sub-"+pubName(o), peerOpts{clean: true, topicAliasMax: 2})
				aliasing.subscribe(subOpt{filter: p + "/#", qos: 2})
				plain := dialPeer(t, subAddr, "oa-plain-"+pubName(o), peerOpts{clean: true})
				plain.subscribe(subOpt{filter: p + "/#", qos: 2})
				pub := dialPeer(t, pubAddr, "oa-pub-"+pubName(o), peerOpts{clean: true})
				sends := []string{"first", "first", "second", "third", "second", "first"}
				for i, s := range sends {
					pub.publish(p+"/"+s, fmt.Sprint(i), o)
				}
				want := []struct {
					wire  string
					alias uint16
				}{{"first", 1}, {"", 1}, {"second", 2}, {"third", 0}, {"", 2}, {"", 1}}
				for i, w := range want {
					m := aliasing.expect(p+"/"+sends[i], fmt.Sprint(i))
					if wire := map[bool]string{true: "", false: p + "/" + w.wire}[w.wire == ""]; m.wireTopic != wire || m.alias != w.alias {
						t.Fatalf("message %d: topic %q alias %d on the wire, want %q alias %d", i, m.wireTopic, m.alias, wire, w.alias)
					}
					if m := plain.expect(p+"/"+sends[i], fmt.Sprint(i)); m.alias != 0 || m.wireTopic == "" {
						t.Fatalf("message %d to a client that takes no aliases: alias %d", i, m.alias)
					}
				}
				if o.retain {
					for _, s := range []string{"first", "second", "third"} {
						clearRetained(pub, p+"/"+s)
					}
				}
			})
		}
	})
}

// Messages a client with topic aliases left unacknowledged come again on
// its next connection with their topics: aliases end with the connection
// (MQTT-3.3.2-10).
func TestPubSubAliasesEndWithTheConnection(t *testing.T) {
	eachTopology(t, func(t *testing.T, pubAddr, subAddr string) {
		first := dialPeer(t, subAddr, "ae-sub", peerOpts{clean: true, sessionExpiry: 300, topicAliasMax: 5, manualAck: true})
		first.subscribe(subOpt{filter: "ae/#", qos: 1})
		pub := dialPeer(t, pubAddr, "ae-pub", peerOpts{clean: true})
		for i := range 3 {
			pub.publish("ae/topic", fmt.Sprint(i), pubOpt{qos: 1})
		}
		for i := range 3 {
			m := first.expect("ae/topic", fmt.Sprint(i))
			if (i == 0) != (m.wireTopic != "") || m.alias != 1 {
				t.Fatalf("message %d: topic %q alias %d", i, m.wireTopic, m.alias)
			}
		}
		first.conn.Close()
		<-first.closed
		again := dialPeer(t, subAddr, "ae-sub", peerOpts{sessionExpiry: 300}) // takes no aliases now
		for i := range 3 {
			if m := again.expect("ae/topic", fmt.Sprint(i)); m.wireTopic != "ae/topic" || m.alias != 0 || !m.dup {
				t.Fatalf("resent message %d: topic %q alias %d dup %v", i, m.wireTopic, m.alias, m.dup)
			}
		}
	})
}
