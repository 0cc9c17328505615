package broker

import (
	"bytes"
	"strings"

	mqtt "github.com/mochi-mqtt/server/v2"
	"github.com/mochi-mqtt/server/v2/packets"

	"github.com/mqkv/mqkv/internal/statestore"
)

// hook connects mochi's events to the broker: it takes state store
// requests off the request topic, protects the notification namespace and
// ends state store registrations with their connection.
type hook struct {
	mqtt.HookBase
	b *Broker
}

func (h *hook) ID() string { return "mqkv" }

func (h *hook) Provides(b byte) bool {
	return bytes.Contains([]byte{
		mqtt.OnConnectAuthenticate,
		mqtt.OnACLCheck,
		mqtt.OnPublish,
		mqtt.OnDisconnect,
		mqtt.OnPacketEncode,
	}, []byte{b})
}

// OnPacketEncode keeps user properties on PUBLISH packets to clients that
// connected with Request Problem Information = 0. mochi drops them from
// every packet then, but MQTT 5 (3.1.2.11.7) only forbids them on packets
// other than PUBLISH, CONNACK and DISCONNECT; without them a reply loses
// __stat and __ts and no AIO client accepts it.
func (h *hook) OnPacketEncode(_ *mqtt.Client, pk packets.Packet) packets.Packet {
	if pk.FixedHeader.Type == packets.Publish {
		pk.Mods.DisallowProblemInfo = false
	}
	return pk
}

func (h *hook) OnConnectAuthenticate(*mqtt.Client, packets.Packet) bool { return true }

// OnACLCheck keeps clients from publishing into the notification namespace,
// where they could forge notifications for other clients.
func (h *hook) OnACLCheck(cl *mqtt.Client, topic string, write bool) bool {
	return !write || !strings.HasPrefix(topic, statestore.NotifyPrefix)
}

// OnPublish hands requests to the state store. They are not routed to
// subscribers: CodeSuccessIgnore still acknowledges QoS 1 (returning
// ErrRejectPacket would not, mochi issue #465).
func (h *hook) OnPublish(cl *mqtt.Client, pk packets.Packet) (packets.Packet, error) {
	if pk.TopicName != statestore.RequestTopic || cl.Net.Inline {
		return pk, nil
	}
	req := &statestore.Request{
		ClientID:        cl.ID,
		Conn:            h.b.connID(cl),
		Payload:         pk.Payload,
		ResponseTopic:   pk.Properties.ResponseTopic,
		CorrelationData: pk.Properties.CorrelationData,
		QoS:             pk.FixedHeader.Qos,
		MessageExpiry:   pk.Properties.MessageExpiryInterval,
	}
	for _, u := range pk.Properties.User {
		switch u.Key {
		case "__ts":
			req.Timestamp, req.HasTimestamp = u.Val, true
		case "__ft":
			req.FencingToken, req.HasFencingToken = u.Val, true
		}
	}
	h.b.handler.Handle(req)
	return pk, packets.CodeSuccessIgnore
}

func (h *hook) OnDisconnect(cl *mqtt.Client, _ error, _ bool) {
	if v, ok := h.b.conns.LoadAndDelete(cl); ok {
		h.b.handler.Disconnected(cl.ID, v.(uint64))
	}
	h.b.dropNotifySubscription(cl)
}
