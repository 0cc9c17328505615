package attach

import (
	"bytes"
	"context"
	"time"

	"github.com/hashicorp/go-msgpack/v2/codec"

	"github.com/mqkv/mqkv/internal/hlc"
	"github.com/mqkv/mqkv/internal/records"
	"github.com/mqkv/mqkv/internal/statestore"
	"github.com/mqkv/mqkv/internal/store"
)

// A requester's KEYNOTIFY registrations live in one attached process of
// a cluster. The broker hands each request to any member of the shared
// subscription, so a KEYNOTIFY ... STOP would reach a process that does
// not hold the registration half of the time with two processes (it
// answered ":0", which the Go SDK takes for an error, and the other
// process went on notifying), and a second registration of the same key
// in another process would notify twice. So every KEYNOTIFY of a
// requester is served by the process the store names for it (a record
// under notifyPrefix, by requester): the one that received its first,
// or, once that one stops answering, the next that receives one (the
// registrations of a dead process are gone with it, as they are when a
// lone process restarts). A process that receives a KEYNOTIFY for a
// requester served elsewhere hands it over the node link (Forwarder);
// the serving process answers it as if it had received it.

// notifyPrefix keys the records naming, per requester, the node whose
// attached process serves its KEYNOTIFY registrations.
const notifyPrefix = store.ReservedPrefix + "attach-notify/"

// notifyRecord names the node whose attached process serves a
// requester's registrations. Wire format (records: msgpack by field name).
type notifyRecord struct{ Node string }

// Forwarder reaches another member's attached process (the mesh): its
// Answer answers body.
type Forwarder interface {
	Request(node string, body []byte, reply func(answer []byte, ok bool))
}

// forwardMark starts a forwarded request among the bodies the node link
// carries between members (the broker's start with a msgpack map).
const forwardMark = 0x00

// forwarded is a request handed to the process serving its requester's
// registrations. Wire format (msgpack by field name, after forwardMark).
type forwarded struct {
	ClientID        string
	Payload         []byte
	ResponseTopic   string
	CorrelationData []byte
	QoS             byte
	MessageExpiry   uint32
	Timestamp       string
	HasTimestamp    bool
	FencingToken    string
	HasFencing      bool
}

var wire = &codec.MsgpackHandle{}

// IsForwarded reports whether a node link body is a forwarded request
// (for Answer), not the broker's.
func IsForwarded(body []byte) bool { return len(body) > 0 && body[0] == forwardMark }

// Answer takes a request another member's attached process forwarded:
// it is served here, its reply published from here. It answers "ok"
// once the request is taken.
func (a *Attach) Answer(body []byte) []byte {
	r, ok := decodeForwarded(body)
	if !ok || a.closing.Load() {
		return nil
	}
	a.Requests.Add(1)
	a.take(&work{r: r}) // no packet: the forwarding process acknowledges it
	return []byte("ok")
}

// appendForwarded appends r's forwarded form to b.
func appendForwarded(b []byte, r *statestore.Request) []byte {
	var enc []byte
	codec.NewEncoderBytes(&enc, wire).MustEncode(forwardedOf(r))
	return append(append(b, forwardMark), enc...)
}

// forwardedOf is what of r is forwarded.
func forwardedOf(r *statestore.Request) forwarded {
	return forwarded{ClientID: r.ClientID, Payload: r.Payload, ResponseTopic: r.ResponseTopic, CorrelationData: r.CorrelationData,
		QoS: r.QoS, MessageExpiry: r.MessageExpiry, Timestamp: r.Timestamp, HasTimestamp: r.HasTimestamp,
		FencingToken: r.FencingToken, HasFencing: r.HasFencingToken}
}

// decodeForwarded reads what appendForwarded wrote: a request that is
// not a KEYNOTIFY, or names no requester, is refused.
func decodeForwarded(body []byte) (*statestore.Request, bool) {
	if !IsForwarded(body) {
		return nil, false
	}
	var f forwarded
	if codec.NewDecoderBytes(body[1:], wire).Decode(&f) != nil || f.ClientID == "" || !isKeyNotify(f.Payload) ||
		statestore.ForbiddenResponseTopic(f.ResponseTopic) {
		return nil, false
	}
	return &statestore.Request{ClientID: f.ClientID, Payload: f.Payload, ResponseTopic: f.ResponseTopic,
		CorrelationData: f.CorrelationData, QoS: f.QoS, MessageExpiry: f.MessageExpiry,
		Timestamp: f.Timestamp, HasTimestamp: f.HasTimestamp, FencingToken: f.FencingToken, HasFencingToken: f.HasFencing}, true
}

// isKeyNotify reports whether payload is a KEYNOTIFY request: its first
// bulk string ("*<n>\r\n$9\r\nKEYNOTIFY\r\n..."). It is asked of every
// request a cluster's attached process takes, so it looks at those bytes
// only; the service parses the request.
func isKeyNotify(payload []byte) bool {
	i := bytes.IndexByte(payload, '\n')
	if i < 0 || !bytes.HasPrefix(payload[i+1:], []byte("$9\r\n")) {
		return false
	}
	verb := payload[i+1+len("$9\r\n"):]
	return len(verb) >= len("KEYNOTIFY") && bytes.EqualFold(verb[:len("KEYNOTIFY")], []byte("KEYNOTIFY"))
}

// routeKeyNotify serves w, a KEYNOTIFY, here or in the process that
// serves its requester's registrations.
func (a *Attach) routeKeyNotify(w *work) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	owner, err := a.notifyOwner(ctx, w.r.ClientID)
	if err != nil {
		a.log.Warn("KEYNOTIFY served here: cannot learn which process serves the requester's registrations", "client", w.r.ClientID, "error", err)
	}
	if err != nil || owner == a.cfg.NodeID {
		a.take(w)
		return
	}
	r := w.r
	a.cfg.Forwarder.Request(owner, appendForwarded(nil, r), func(answer []byte, ok bool) {
		if ok && string(answer) == "ok" {
			a.Forwarded.Add(1)
			a.ack(w)
			return
		}
		// Not taken there (it stopped, or runs a release without
		// this): served here.
		a.log.Info("KEYNOTIFY served here: the process serving the requester's registrations did not take it", "client", r.ClientID, "node", owner)
		go a.take(w) // not on the node link's goroutine: take may wait for a worker
	})
}

// notifyOwner returns the node whose process serves clientID's
// registrations, naming this one if none does, or if the one named
// stopped answering.
//
// A record lives twice RequesterIdle unless renewed: here when a
// KEYNOTIFY finds it past half its life, and by sweepRequesters while the
// requester holds registrations here. So the records of requesters that
// are gone, or whose process is, end; a requester's next KEYNOTIFY names
// a process again.
func (a *Attach) notifyOwner(ctx context.Context, clientID string) (string, error) {
	key := []byte(notifyPrefix + clientID)
	for attempt := 0; ; attempt++ {
		node, e, err := a.readNotifyRecord(ctx, key)
		if err != nil {
			return "", err
		}
		switch {
		case node == a.cfg.NodeID && !a.renewDue(e):
			return node, nil
		case node != "" && node != a.cfg.NodeID && a.cfg.Cluster.Alive(node):
			return node, nil
		}
		// None, its process stopped answering (or a later release wrote
		// it): taken over; or this one's, renewed.
		res, err := a.nameSelf(ctx, key, e.Version)
		if err != nil {
			return "", err
		}
		if res.Outcome == store.Applied {
			return a.cfg.NodeID, nil
		}
		if attempt > 0 {
			return a.cfg.NodeID, nil // contended: served here
		}
		// Another process named itself meanwhile: read it.
	}
}

// nameSelf writes the record naming this process, on condition that the
// key is still at version expected (zero: absent).
func (a *Attach) nameSelf(ctx context.Context, key []byte, expected hlc.Timestamp) (store.Result, error) {
	return records.Submit(ctx, a.cfg.Cluster, store.Command{Op: store.OpSet, Key: key,
		Value: records.Encode(recordFormat, notifyRecord{Node: a.cfg.NodeID}), Cond: store.IfVersion, Expected: expected,
		TTL: a.notifyRecordTTL().Milliseconds()})
}

// notifyRecordTTL is how long a record naming a process lives unless
// renewed.
func (a *Attach) notifyRecordTTL() time.Duration { return 2 * a.cfg.RequesterIdle }

// renewDue reports whether e, a record naming this process, is past half
// its life (or, written by a release before records expired, has none).
func (a *Attach) renewDue(e store.Entry) bool {
	return e.ExpiresAt == 0 || time.Until(time.UnixMilli(e.ExpiresAt)) < a.notifyRecordTTL()/2
}

// renewNotifyRecord renews the record naming this process for q, which
// holds registrations here, once it is past half its life. A record
// naming another process (taken over meanwhile) is left to it; a record
// that ended is written again. An error says the store did not answer.
func (a *Attach) renewNotifyRecord(ctx context.Context, q *requester) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	key := []byte(notifyPrefix + q.id)
	node, e, err := a.readNotifyRecord(ctx, key)
	if err != nil {
		return err
	}
	if found := !e.Version.IsZero(); found && (node != a.cfg.NodeID || !a.renewDue(e)) {
		return nil // another process's (taken over), left to it; or not due
	}
	_, err = a.nameSelf(ctx, key, e.Version)
	return err
}

// readNotifyRecord reads the record at key: the node it names ("" when
// there is none, or it cannot be decoded), and its entry (zero when
// absent).
func (a *Attach) readNotifyRecord(ctx context.Context, key []byte) (string, store.Entry, error) {
	e, found, err := a.cfg.Cluster.Get(ctx, key)
	if err != nil || !found {
		return "", store.Entry{}, err
	}
	var n notifyRecord
	if records.Decode("attached requester's record", recordFormat, e.Value, &n) != nil {
		return "", e, nil
	}
	return n.Node, e, nil
}
