// Package auth establishes who a connecting client is: username and
// password checked against a password file of bcrypt hashes (the format
// `mqkv passwd` writes, like mosquitto_passwd), or an X.509 client
// certificate whose subject CN becomes the username and whose chain
// yields principal attributes.
package auth

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"golang.org/x/crypto/bcrypt"
)

// Passwords is a loaded password file: one "username:bcrypt-hash" per line;
// blank lines and lines starting with '#' are ignored.
type Passwords struct {
	hashes map[string][]byte
	// verified remembers successful checks (by a digest of username and
	// password), so reconnecting clients do not pay bcrypt's deliberate
	// cost again. Failures are never cached.
	mu       sync.Mutex
	verified map[[32]byte]struct{}
	// cost is the highest bcrypt cost of the file's hashes: a check for
	// an unknown user compares against a hash of that cost.
	cost int
}

// maxPasswordFile bounds what ParsePasswords reads.
const maxPasswordFile = 16 << 20

// ParsePasswords reads a password file's contents.
func ParsePasswords(b []byte) (*Passwords, error) {
	if len(b) > maxPasswordFile {
		return nil, fmt.Errorf("password file larger than %d bytes", maxPasswordFile)
	}
	p := &Passwords{hashes: map[string][]byte{}, verified: map[[32]byte]struct{}{}}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 4096), maxPasswordFile)
	line := 0
	for sc.Scan() {
		line++
		text := strings.TrimRight(sc.Text(), "\r")
		if strings.TrimSpace(text) == "" || strings.HasPrefix(strings.TrimSpace(text), "#") {
			continue
		}
		user, hash, ok := strings.Cut(text, ":")
		if !ok || user == "" {
			return nil, fmt.Errorf("line %d: want username:hash", line)
		}
		c, err := bcrypt.Cost([]byte(hash))
		if err != nil {
			return nil, fmt.Errorf("line %d: user %q: not a bcrypt hash (write entries with `mqkv passwd`)", line, user)
		}
		p.cost = max(p.cost, c)
		if _, dup := p.hashes[user]; dup {
			return nil, fmt.Errorf("line %d: user %q listed twice", line, user)
		}
		p.hashes[user] = []byte(hash)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return p, nil
}

// LoadPasswords reads a password file.
func LoadPasswords(file string) (*Passwords, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("password file: %w", err)
	}
	p, err := ParsePasswords(b)
	if err != nil {
		return nil, fmt.Errorf("password file %s: %w", file, err)
	}
	return p, nil
}

// Users returns how many users the file lists.
func (p *Passwords) Users() int { return len(p.hashes) }

// Check reports whether password is user's. A password sent with a line
// ending at its end is taken without it: the AIO SDKs send the file named
// by AIO_MQTT_PASSWORD_FILE as it is, and most editors end a file with a
// newline. (Stored passwords never end with one: mqkv passwd reads a line.)
func (p *Passwords) Check(user string, password []byte) bool {
	if trimmed := bytes.TrimRight(password, "\r\n"); len(trimmed) < len(password) {
		return p.check(user, trimmed)
	}
	return p.check(user, password)
}

func (p *Passwords) check(user string, password []byte) bool {
	hash, ok := p.hashes[user]
	if !ok {
		// Spend the same time as a wrong password, so probing does not
		// reveal which usernames exist.
		bcrypt.CompareHashAndPassword(dummyHash(p.cost), password)
		return false
	}
	d := sha256.New()
	d.Write([]byte(user))
	d.Write([]byte{0})
	d.Write(hash)
	d.Write([]byte{0})
	d.Write(password)
	var key [32]byte
	d.Sum(key[:0])
	p.mu.Lock()
	_, hit := p.verified[key]
	p.mu.Unlock()
	if hit {
		return true
	}
	if bcrypt.CompareHashAndPassword(hash, password) != nil {
		return false
	}
	p.mu.Lock()
	if len(p.verified) > 10000 {
		clear(p.verified)
	}
	p.verified[key] = struct{}{}
	p.mu.Unlock()
	return true
}

// cost is bcrypt's work factor for new hashes; tests lower it.
var cost = bcrypt.DefaultCost

// dummyHash returns a hash of cost, compared against when a user is
// unknown, so that a miss costs what a wrong password does. The one of
// bcrypt's default cost, which `mqkv passwd` writes, is made beforehand:
// made on the first miss, it doubled that miss's time (a full bcrypt
// more; 1.5 s under the race detector), which told that the user is
// unknown. Others are made on first use.
func dummyHash(cost int) []byte {
	if cost == bcrypt.DefaultCost {
		return defaultDummy
	}
	dummies.Lock()
	defer dummies.Unlock()
	h, ok := dummies.m[cost]
	if !ok {
		h, _ = bcrypt.GenerateFromPassword([]byte("mqkv-dummy"), max(cost, bcrypt.MinCost))
		dummies.m[cost] = h
	}
	return h
}

// defaultDummy is bcrypt("mqkv-dummy") at bcrypt.DefaultCost (10).
var defaultDummy = []byte("$2a$10$0tegucfVO2OeRGqqo9woD..C.GaVINE7TEpCKLqHT1ie.Mhtx2VbK")

var dummies = struct {
	sync.Mutex
	m map[int][]byte
}{m: map[int][]byte{}}

// SetPassword adds or replaces user's entry in file (creating it), keeping
// other entries and comments; the file is replaced atomically.
func SetPassword(file, user string, password []byte) error {
	if user == "" || strings.ContainsAny(user, ":\r\n") {
		return errors.New("passwd: a username must be non-empty and contain no ':' or line breaks")
	}
	if len(password) == 0 {
		return errors.New("passwd: empty password")
	}
	hash, err := bcrypt.GenerateFromPassword(password, cost)
	if err != nil {
		return fmt.Errorf("passwd: %w", err)
	}
	return rewrite(file, user, user+":"+string(hash))
}

// DeletePassword removes user's entry from file.
func DeletePassword(file, user string) error { return rewrite(file, user, "") }

// rewrite replaces the line of user by entry ("" removes it), or appends it.
func rewrite(file, user, entry string) error {
	old, err := os.ReadFile(file)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if len(old) > 0 {
		if _, err := ParsePasswords(old); err != nil {
			return fmt.Errorf("passwd: %s: %w", file, err)
		}
	}
	var lines []string
	found := false
	for _, l := range strings.Split(strings.TrimRight(string(old), "\n"), "\n") {
		if l == "" {
			continue
		}
		if u, _, _ := strings.Cut(l, ":"); u == user && !strings.HasPrefix(l, "#") {
			found = true
			if entry != "" {
				lines = append(lines, entry)
			}
			continue
		}
		lines = append(lines, l)
	}
	if !found {
		if entry == "" {
			return fmt.Errorf("passwd: no user %q in %s", user, file)
		}
		lines = append(lines, entry)
	}
	tmp, err := os.CreateTemp(filepath.Dir(file), ".passwd-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(strings.Join(lines, "\n") + "\n"); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), file)
}

// sortedUsers is for tests and listings.
func (p *Passwords) sortedUsers() []string {
	var out []string
	for u := range p.hashes {
		out = append(out, u)
	}
	sort.Strings(out)
	return out
}
