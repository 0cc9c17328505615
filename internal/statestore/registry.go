package statestore

import (
	"sync"
	"sync/atomic"
)

// observer is one client's set of KEYNOTIFY registrations, tied to the
// connection that made them: they end when it disconnects, and a new
// connection of the same client starts from none.
type observer struct {
	clientID    string
	conn        uint64
	topicPrefix string // NotifyClientPrefix(clientID), computed once
	keys        map[string]struct{}
}

// registry maps keys to the clients observing them.
type registry struct {
	mu       sync.RWMutex
	byKey    map[string][]*observer
	byClient map[string]*observer
	active   *atomic.Int64
}

func newRegistry(active *atomic.Int64) *registry {
	return &registry{byKey: map[string][]*observer{}, byClient: map[string]*observer{}, active: active}
}

// add registers clientID (on conn) for key; repeating it is harmless. It
// refuses a new registration beyond max per connection (0: no limit).
func (r *registry) add(clientID string, conn uint64, key []byte, max int) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	o := r.byClient[clientID]
	if o != nil && o.conn != conn {
		// Registrations of an earlier connection that has not yet been
		// reported closed end now.
		r.dropLocked(o)
		o = nil
	}
	if o == nil {
		o = &observer{clientID: clientID, conn: conn, topicPrefix: NotifyClientPrefix(clientID), keys: map[string]struct{}{}}
		r.byClient[clientID] = o
	}
	k := string(key)
	if _, ok := o.keys[k]; ok {
		return true
	}
	if max > 0 && len(o.keys) >= max {
		if len(o.keys) == 0 {
			delete(r.byClient, clientID)
		}
		return false
	}
	o.keys[k] = struct{}{}
	r.byKey[k] = append(r.byKey[k], o)
	r.active.Add(1)
	return true
}

// revoke ends the registrations of conn for keys keep refuses.
func (r *registry) revoke(clientID string, conn uint64, keep func(key []byte) bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	o := r.byClient[clientID]
	if o == nil || o.conn != conn {
		return
	}
	for k := range o.keys {
		if !keep([]byte(k)) {
			delete(o.keys, k)
			r.unlinkLocked(k, o)
			r.active.Add(-1)
		}
	}
	if len(o.keys) == 0 {
		delete(r.byClient, clientID)
	}
}

// remove ends one registration and reports whether there was one.
func (r *registry) remove(clientID string, conn uint64, key []byte) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	o := r.byClient[clientID]
	if o == nil || o.conn != conn {
		return false
	}
	k := string(key)
	if _, ok := o.keys[k]; !ok {
		return false
	}
	delete(o.keys, k)
	r.unlinkLocked(k, o)
	r.active.Add(-1)
	if len(o.keys) == 0 {
		delete(r.byClient, clientID)
	}
	return true
}

// dropConn ends every registration made on conn.
func (r *registry) dropConn(clientID string, conn uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if o := r.byClient[clientID]; o != nil && o.conn == conn {
		r.dropLocked(o)
	}
}

func (r *registry) dropLocked(o *observer) {
	for k := range o.keys {
		r.unlinkLocked(k, o)
	}
	r.active.Add(-int64(len(o.keys)))
	delete(r.byClient, o.clientID)
}

func (r *registry) unlinkLocked(k string, o *observer) {
	old := r.byKey[k]
	// Copy on write: a slice handed out by lookup is never modified.
	list := make([]*observer, 0, len(old))
	for _, x := range old {
		if x != o {
			list = append(list, x)
		}
	}
	if len(list) == 0 {
		delete(r.byKey, k)
	} else {
		r.byKey[k] = list
	}
}

// lookup returns the observers of key. The slice must not be modified.
func (r *registry) lookup(key []byte) []*observer {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.byKey[string(key)]
}
