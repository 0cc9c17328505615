package redis

// keyCounts counts a connection's writes in flight by key (keyHash):
// an open-addressing table with linear probing, as the connection asks
// it for every write, twice, and tells it once more when the write is
// answered. Why not a map: its hashing and probing were a twentieth of a
// pipelined SET's CPU (docs/benchmarks.md, issue 32, seventh). The keys
// are hashes already, spread over every bit; a slot is free while its
// count is 0, so any key, 0 too, may be counted.
type keyCounts struct {
	slots []keyCount // a power of two long, at most half full
	n     int        // keys counted
}

type keyCount struct {
	key uint64
	n   int32
}

// get returns how many writes to key are counted.
func (t *keyCounts) get(key uint64) int32 {
	if t.n == 0 {
		return 0
	}
	m := uint64(len(t.slots) - 1)
	for i := key & m; ; i = (i + 1) & m {
		s := &t.slots[i]
		if s.n == 0 {
			return 0
		}
		if s.key == key {
			return s.n
		}
	}
}

// add counts one more write to key.
func (t *keyCounts) add(key uint64) {
	if 2*(t.n+1) > len(t.slots) {
		t.grow()
	}
	m := uint64(len(t.slots) - 1)
	for i := key & m; ; i = (i + 1) & m {
		s := &t.slots[i]
		if s.n == 0 {
			s.key, s.n = key, 1
			t.n++
			return
		}
		if s.key == key {
			s.n++
			return
		}
	}
}

// remove counts one write to key fewer; a key not counted is ignored.
// A key whose count comes to 0 leaves the table by backward shift: the
// keys after it in its run move back into the hole if their home slot
// allows, so that no tombstone is left for lookups to step over.
func (t *keyCounts) remove(key uint64) {
	if t.n == 0 {
		return
	}
	m := uint64(len(t.slots) - 1)
	i := key & m
	for t.slots[i].n == 0 || t.slots[i].key != key {
		if t.slots[i].n == 0 {
			return
		}
		i = (i + 1) & m
	}
	if t.slots[i].n--; t.slots[i].n > 0 {
		return
	}
	t.n--
	for j := (i + 1) & m; t.slots[j].n != 0; j = (j + 1) & m {
		// The key at j may move to the hole at i unless its home h lies
		// cyclically in (i, j]: then it would be before its home.
		h := t.slots[j].key & m
		if (j-h)&m >= (j-i)&m {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = keyCount{}
}

// grow doubles the table (32 slots at first), placing every key anew.
func (t *keyCounts) grow() {
	old := t.slots
	t.slots = make([]keyCount, max(32, 2*len(old)))
	t.n = 0
	m := uint64(len(t.slots) - 1)
	for _, s := range old {
		if s.n == 0 {
			continue
		}
		i := s.key & m
		for t.slots[i].n != 0 {
			i = (i + 1) & m
		}
		t.slots[i] = s
		t.n++
	}
}
