package attach

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/eclipse/paho.golang/autopaho"
	"github.com/eclipse/paho.golang/paho"

	"github.com/mqkv/mqkv/internal/records"
	"github.com/mqkv/mqkv/internal/store"
	"github.com/mqkv/mqkv/internal/topics"
)

// Rescue: the requests an attached process of a cluster had taken when
// it died, and those the broker goes on handing its session meanwhile.
//
// An MQTT 5 broker may hand a shared subscription's message to another
// member once the first one's connection is lost (section 4.8.2);
// mosquitto 2 does not: it keeps them in the dead member's session, and
// goes on giving that session its share of new requests while the
// session lasts. So another attached process takes the session over:
// it connects with the dead one's client id (CleanStart false), gets the
// requests the session holds, unsubscribes it from the request topic,
// answers them, and ends the session (its connection asked for a session
// expiry of 0). A write among them that the dead process had executed is
// not executed again: the store remembers its request (statestore's
// Request.ID). Measured with mosquitto 2.0: of 10 requests taken and not
// acknowledged by a process whose connection was cut, and 10 of 20 sent
// after it to its session, the rescuer got all 20; after its unsubscribe
// the other member got every new request, and the session was gone.
//
// Each attached process names its client id in the store (a record
// under recordPrefix, by node id), so a member can find a dead one's
// session; the live attached member with the lowest node id rescues.

// recordPrefix keys the attached processes' records, by node id.
const recordPrefix = store.ReservedPrefix + "attached/"

const recordFormat = 1

// record is an attached process's record. Wire format (records: msgpack
// by field name).
type record struct {
	ClientID string
	Group    string
}

// Cluster is what rescuing needs of the cluster an attached process is a
// member of, and of its store (cluster.Node).
type Cluster interface {
	// Members are the members' ids (keys).
	Members() map[string]string
	// Alive reports whether a member answers.
	Alive(id string) bool
	// Get reads a key (linearizable).
	Get(ctx context.Context, key []byte) (store.Entry, bool, error)
	records.Submitter
	records.Ascender
}

// rescueQuiet is how long a rescued session must stay quiet, every
// request it held answered, before it is ended: the broker sends what
// the session holds right after the connection, and a request that came
// later would be lost with it.
const rescueQuiet = time.Second

// rescueTimeout bounds a rescue.
const rescueTimeout = 30 * time.Second

// Rescue takes over the session of clientID, an attached process of the
// same store that died, subscribed in share group group; answers the
// requests the session holds, and ends it. It returns how many requests
// it answered.
func (a *Attach) Rescue(ctx context.Context, clientID, group string) (int, error) {
	if clientID == a.cfg.ClientID {
		return 0, errors.New("attach: a process does not rescue itself")
	}
	ctx, cancel := context.WithTimeout(ctx, rescueTimeout)
	defer cancel()
	var (
		got, pending atomic.Int64
		last         atomic.Int64 // unix ns of the last request
	)
	up := make(chan *paho.Connack, 1)
	// The dead process's session (CleanStart false), ended with this
	// connection (no expiry).
	pc := a.connection(clientID, 0)
	pc.OnConnectionUp = func(_ *autopaho.ConnectionManager, ca *paho.Connack) {
		select {
		case up <- ca:
		default:
		}
	}
	// Once: a session lost with this connection is ended; one taken back
	// by its process (it was not dead) is its own again.
	pc.OnConnectionDown = func() bool { return false }
	pc.OnPublishReceived = []func(paho.PublishReceived) (bool, error){func(pr paho.PublishReceived) (bool, error) {
		got.Add(1)
		pending.Add(1)
		last.Store(time.Now().UnixNano())
		a.receiveWith(pr.Client, pr.Packet, func() { pending.Add(-1) })
		return true, nil
	}}
	cm, err := autopaho.NewConnection(ctx, pc)
	if err != nil {
		return 0, fmt.Errorf("attach: rescuing %s: %w", clientID, err)
	}
	defer func() {
		cancel()
		<-cm.Done()
	}()
	var ca *paho.Connack
	select {
	case ca = <-up:
	case <-ctx.Done():
		return 0, fmt.Errorf("attach: rescuing %s: no connection to the broker: %w", clientID, ctx.Err())
	}
	if ca.SessionPresent {
		// No new requests for the session; those it holds still come.
		filter := "$share/" + group + "/" + topics.Request
		if _, err := cm.Unsubscribe(ctx, &paho.Unsubscribe{Topics: []string{filter}}); err != nil {
			a.log.Warn("rescue: cannot unsubscribe the session from the request topic", "client", clientID, "error", err)
		}
		if err := awaitQuiet(ctx, &last, &pending, rescueQuiet); err != nil {
			return int(got.Load()), fmt.Errorf("attach: rescuing %s: %d requests unanswered: %w", clientID, pending.Load(), err)
		}
		// Their acknowledgements go out with paho's next batch.
		time.Sleep(10 * ackEvery)
	}
	dctx, dcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer dcancel()
	cm.Disconnect(dctx)
	return int(got.Load()), nil
}

// watch keeps this process's record in the store, and rescues the
// sessions of attached members of the cluster that stop answering (this
// process does when it is the live attached member with the lowest id),
// until ctx ends.
func (a *Attach) watch(ctx context.Context) {
	defer a.wg.Done()
	c, self := a.cfg.Cluster, a.cfg.NodeID
	t := time.NewTicker(time.Second)
	defer t.Stop()
	announced := false
	rescued := map[string]bool{} // dead members rescued since they died
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !announced && a.Serving() {
			announced = a.announce(ctx, c, self) == nil
		}
		members := c.Members()
		var dead []string
		for id := range members {
			if id == self {
				continue
			}
			if c.Alive(id) {
				delete(rescued, id)
			} else if !rescued[id] {
				dead = append(dead, id)
			}
		}
		if len(dead) == 0 {
			continue
		}
		recs, err := a.records(ctx, c)
		if err != nil {
			continue // the store is not reachable: the next tick
		}
		for _, id := range rescuesDue(self, members, c.Alive, recs, dead) {
			n, err := a.Rescue(ctx, recs[id].ClientID, recs[id].Group)
			if err != nil {
				a.log.Warn("rescue of a dead attached member's requests failed", "node", id, "client", recs[id].ClientID, "error", err)
				continue
			}
			rescued[id] = true
			a.Rescues.Add(1)
			a.Rescued.Add(int64(n))
			a.log.Info("rescued a dead attached member's requests", "node", id, "client", recs[id].ClientID, "requests", n)
		}
	}
}

// rescuesDue returns the dead members whose sessions self rescues: those
// with a record, when self is the live member with a record with the
// lowest id.
func rescuesDue(self string, members map[string]string, alive func(string) bool, recs map[string]record, dead []string) []string {
	var live []string
	for id := range members {
		if _, ok := recs[id]; ok && (id == self || alive(id)) {
			live = append(live, id)
		}
	}
	if len(live) == 0 || slices.Min(live) != self {
		return nil
	}
	var due []string
	for _, id := range dead {
		if _, ok := recs[id]; ok && id != self {
			due = append(due, id)
		}
	}
	slices.Sort(due)
	return due
}

// announce writes this process's record, if the store does not hold it.
func (a *Attach) announce(ctx context.Context, c Cluster, self string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	recs, err := a.records(ctx, c)
	if err != nil {
		return err
	}
	mine := record{ClientID: a.cfg.ClientID, Group: a.cfg.Group}
	if recs[self] == mine {
		return nil
	}
	_, err = records.Submit(ctx, c, store.Command{Op: store.OpSet, Key: []byte(recordPrefix + self), Value: records.Encode(recordFormat, mine)})
	return err
}

// records reads the attached processes' records, by node id.
func (a *Attach) records(ctx context.Context, c Cluster) (map[string]record, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	out := map[string]record{}
	err := records.Scan(ctx, c, []byte(recordPrefix), func(e *store.Entry) {
		var r record
		if records.Decode("attached process record", recordFormat, e.Value, &r) == nil && r.ClientID != "" {
			out[string(e.Key[len(recordPrefix):])] = r
		}
	})
	return out, err
}
