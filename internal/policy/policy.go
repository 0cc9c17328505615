// Package policy decides who may connect, publish, subscribe and touch which
// state store keys. It reads the AIO broker's BrokerAuthorization rules
// (YAML), so an AIO policy carries over unchanged, and compiles them, per
// connected principal, into a Grant that answers each check without
// re-reading the rules.
package policy

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"github.com/mqkv/mqkv/internal/glob"
	"os"
	"strings"

	"gopkg.in/yaml.v3"
)

// Principal is who a connection is: its client id, the username it
// authenticated as (password or certificate CN; empty if anonymous), and
// attributes (from its certificate chain).
type Principal struct {
	ClientID   string
	Username   string
	Attributes map[string]string
}

// Method is what a state store resource grants.
type Method uint8

const (
	Read      Method = 1 << iota // GET, KEYNOTIFY
	Write                        // SET, DEL, VDEL
	ReadWrite = Read | Write
)

type keyType uint8

const (
	keyPattern keyType = iota // glob with {principal.*} substitution
	keyString                 // exact
	keyBinary                 // exact, written in base64
)

type stateRule struct {
	method Method
	kind   keyType
	keys   [][]byte
}

type rule struct {
	clientIDs  []string
	usernames  []string
	attributes []map[string]string
	connect    bool
	publish    []string
	subscribe  []string
	state      []stateRule
}

// Policy is a parsed set of rules. The zero value grants nothing.
type Policy struct {
	rules []rule
}

// Rules returns how many rules the policy has.
func (p *Policy) Rules() int { return len(p.rules) }

// Load reads a policy file.
func Load(file string) (*Policy, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("policy: %w", err)
	}
	p, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("policy %s: %w", file, err)
	}
	return p, nil
}

// The YAML shapes accepted: a whole AIO BrokerAuthorization resource, its
// authorizationPolicies, or just a list of rules under "rules".
type fileYAML struct {
	APIVersion            string        `yaml:"apiVersion"`
	Kind                  string        `yaml:"kind"`
	Metadata              yaml.Node     `yaml:"metadata"`
	Spec                  *specYAML     `yaml:"spec"`
	AuthorizationPolicies *policiesYAML `yaml:"authorizationPolicies"`
	Rules                 []ruleYAML    `yaml:"rules"`
}

type specYAML struct {
	AuthorizationPolicies *policiesYAML `yaml:"authorizationPolicies"`
}

type policiesYAML struct {
	Cache string     `yaml:"cache"`
	Rules []ruleYAML `yaml:"rules"`
}

type ruleYAML struct {
	Principals struct {
		ClientIDs  []string            `yaml:"clientIds"`
		Usernames  []string            `yaml:"usernames"`
		Attributes []map[string]string `yaml:"attributes"`
	} `yaml:"principals"`
	BrokerResources []struct {
		Method string   `yaml:"method"`
		Topics []string `yaml:"topics"`
	} `yaml:"brokerResources"`
	StateStoreResources []struct {
		Method  string   `yaml:"method"`
		KeyType string   `yaml:"keyType"`
		Keys    []string `yaml:"keys"`
	} `yaml:"stateStoreResources"`
}

// maxPolicySize bounds what Parse reads.
const maxPolicySize = 16 << 20

// Parse reads a policy. Unknown fields, methods and key types are errors,
// so a typo cannot silently grant or deny.
func Parse(b []byte) (*Policy, error) {
	if len(b) > maxPolicySize {
		return nil, fmt.Errorf("policy larger than %d bytes", maxPolicySize)
	}
	var f fileYAML
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("yaml: %w", err)
	}
	rules := f.Rules
	switch {
	case f.Spec != nil && f.Spec.AuthorizationPolicies != nil:
		rules = append(rules, f.Spec.AuthorizationPolicies.Rules...)
	case f.AuthorizationPolicies != nil:
		rules = append(rules, f.AuthorizationPolicies.Rules...)
	}
	if f.Kind != "" && f.Kind != "BrokerAuthorization" {
		return nil, fmt.Errorf("kind %q: want BrokerAuthorization", f.Kind)
	}
	p := &Policy{}
	for i, ry := range rules {
		r, err := compileRule(ry)
		if err != nil {
			return nil, fmt.Errorf("rule %d: %w", i+1, err)
		}
		p.rules = append(p.rules, r)
	}
	return p, nil
}

func compileRule(ry ruleYAML) (rule, error) {
	r := rule{
		clientIDs:  ry.Principals.ClientIDs,
		usernames:  ry.Principals.Usernames,
		attributes: ry.Principals.Attributes,
	}
	if len(r.clientIDs)+len(r.usernames)+len(r.attributes) == 0 {
		return r, errors.New("principals must name at least one client id, username or attribute set")
	}
	for _, a := range r.attributes {
		if len(a) == 0 {
			return r, errors.New("an empty attribute set would match everyone")
		}
	}
	for _, br := range ry.BrokerResources {
		switch strings.ToLower(br.Method) {
		case "connect":
			if len(br.Topics) > 0 {
				return r, errors.New("Connect takes no topics")
			}
			r.connect = true
		case "publish", "subscribe":
			if len(br.Topics) == 0 {
				return r, fmt.Errorf("%s needs topics", br.Method)
			}
			for _, t := range br.Topics {
				if err := checkFilter(t); err != nil {
					return r, fmt.Errorf("%s topic %q: %w", br.Method, t, err)
				}
			}
			if strings.EqualFold(br.Method, "publish") {
				r.publish = append(r.publish, br.Topics...)
			} else {
				r.subscribe = append(r.subscribe, br.Topics...)
			}
		default:
			return r, fmt.Errorf("broker resource method %q: want Connect, Publish or Subscribe", br.Method)
		}
	}
	for _, sr := range ry.StateStoreResources {
		var s stateRule
		switch strings.ToLower(sr.Method) {
		case "read":
			s.method = Read
		case "write":
			s.method = Write
		case "readwrite":
			s.method = ReadWrite
		default:
			return r, fmt.Errorf("state store method %q: want Read, Write or ReadWrite", sr.Method)
		}
		switch strings.ToLower(sr.KeyType) {
		case "", "pattern":
			s.kind = keyPattern
		case "string":
			s.kind = keyString
		case "binary":
			s.kind = keyBinary
		default:
			return r, fmt.Errorf("keyType %q: want Pattern, String or Binary", sr.KeyType)
		}
		if len(sr.Keys) == 0 {
			return r, errors.New("a state store resource needs keys")
		}
		for _, k := range sr.Keys {
			if s.kind == keyBinary {
				b, err := base64.StdEncoding.DecodeString(k)
				if err != nil {
					return r, fmt.Errorf("binary key %q is not base64: %w", k, err)
				}
				s.keys = append(s.keys, b)
				continue
			}
			if k == "" {
				return r, errors.New("empty key")
			}
			if s.kind == keyPattern {
				if err := checkVariables(k); err != nil {
					return r, fmt.Errorf("key %q: %w", k, err)
				}
			}
			s.keys = append(s.keys, []byte(k))
		}
		r.state = append(r.state, s)
	}
	return r, nil
}

// checkFilter validates a topic filter of a rule (with variables).
func checkFilter(f string) error {
	if f == "" {
		return errors.New("empty topic")
	}
	if err := checkVariables(f); err != nil {
		return err
	}
	levels := strings.Split(f, "/")
	for i, l := range levels {
		if strings.Contains(l, "#") && (l != "#" || i != len(levels)-1) {
			return errors.New("'#' must be the whole last level")
		}
		if strings.Contains(l, "+") && l != "+" {
			return errors.New("'+' must be a whole level")
		}
	}
	return nil
}

const varPrefix = "{principal."

// checkVariables rejects unknown or unterminated {principal.*} variables.
func checkVariables(s string) error {
	for {
		i := strings.Index(s, "{")
		if i < 0 {
			return nil
		}
		j := strings.Index(s[i:], "}")
		if j < 0 {
			return errors.New("unterminated '{'")
		}
		v := s[i : i+j+1]
		switch {
		case v == "{principal.clientId}", v == "{principal.username}":
		case strings.HasPrefix(v, "{principal.attributes.") && len(v) > len("{principal.attributes.}"):
		default:
			return fmt.Errorf("unknown variable %s (want {principal.clientId}, {principal.username} or {principal.attributes.NAME})", v)
		}
		s = s[i+j+1:]
	}
}

// substitute replaces {principal.*} variables with the principal's values,
// each passed through escape. It reports false when a variable has no value
// (the entry then grants nothing) or escape refuses a value.
func substitute(s string, p *Principal, escape func(string) (string, bool)) (string, bool) {
	if !strings.Contains(s, varPrefix) {
		return s, true
	}
	var b strings.Builder
	for {
		i := strings.Index(s, varPrefix)
		if i < 0 {
			b.WriteString(s)
			return b.String(), true
		}
		j := strings.IndexByte(s[i:], '}')
		name := s[i+len(varPrefix) : i+j]
		var val string
		switch {
		case name == "clientId":
			val = p.ClientID
		case name == "username":
			val = p.Username
		case strings.HasPrefix(name, "attributes."):
			val = p.Attributes[strings.TrimPrefix(name, "attributes.")]
		}
		if val == "" {
			return "", false
		}
		val, ok := escape(val)
		if !ok {
			return "", false
		}
		b.WriteString(s[:i])
		b.WriteString(val)
		s = s[i+j+1:]
	}
}

// topicValue keeps substituted values from acting as wildcards (a value
// with '+' or '#' cannot be part of any valid topic name anyway) or from
// reaching into another principal's subtree ("victim/x"), or into $ topics.
func topicValue(v string) (string, bool) {
	return v, !strings.ContainsAny(v, "+#/") && !strings.HasPrefix(v, "$")
}

// globValue makes a substituted value match only itself, and keeps it from
// reaching into another principal's keys ("victim/x").
func globValue(v string) (string, bool) { return glob.Escape(v), !strings.Contains(v, "/") }

// applies reports whether a rule's principals include p: client ids,
// usernames and attribute sets are alternatives (OR); within an attribute
// set every pair must match (AND).
func (r *rule) applies(p *Principal) bool {
	for _, id := range r.clientIDs {
		if nameMatches(id, p.ClientID) {
			return true
		}
	}
	if p.Username != "" {
		for _, u := range r.usernames {
			if nameMatches(u, p.Username) {
				return true
			}
		}
	}
	for _, set := range r.attributes {
		all := true
		for k, v := range set {
			if got, ok := p.Attributes[k]; !ok || got != v {
				all = false
				break
			}
		}
		if all {
			return true
		}
	}
	return false
}

// nameMatches matches a client id or username of a rule, which may be a
// glob ("sensor-*").
func nameMatches(pattern, name string) bool {
	if !strings.ContainsAny(pattern, "*?[\\") {
		return pattern == name
	}
	return glob.Match([]byte(pattern), []byte(name))
}
