package policy

import (
	"github.com/mqkv/mqkv/internal/glob"
	"testing"
)

// An AIO BrokerAuthorization resource, as an operator has it.
const aioPolicy = `
apiVersion: connectivity.iotoperations.azure.com/v1
kind: BrokerAuthorization
metadata:
  name: my-authz-policies
  namespace: azure-iot-operations
spec:
  authorizationPolicies:
    cache: Enabled
    rules:
      - principals:
          clientIds:
            - "temperature-sensor"
            - "humidity-sensor"
          attributes:
            - city: "seattle"
              organization: "contoso"
        brokerResources:
          - method: Connect
          - method: Publish
            topics:
              - "/sensor/{principal.clientId}"
              - "/sensor/{principal.attributes.organization}"
          - method: Subscribe
            topics:
              - "/commands/{principal.attributes.organization}"
        stateStoreResources:
          - method: Read
            keyType: "Pattern"
            keys:
              - "myreadkey"
              - "myotherkey?"
              - "mynumerickeysuffix[0-9]"
              - "clients/{principal.clientId}/*"
          - method: ReadWrite
            keyType: "Binary"
            keys:
              - "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx="
`

func TestParseAIOResource(t *testing.T) {
	p, err := Parse([]byte(aioPolicy))
	if err != nil {
		t.Fatal(err)
	}
	if p.Rules() != 1 {
		t.Fatalf("rules = %d", p.Rules())
	}
	g := p.Grant(Principal{ClientID: "temperature-sensor"})
	if !g.CanConnect() || !g.CanPublish("/sensor/temperature-sensor") || g.CanPublish("/sensor/humidity-sensor") {
		t.Fatal("client id substitution in publish topics")
	}
	if g.CanPublish("/sensor/contoso") {
		t.Fatal("an unresolved attribute granted a topic")
	}
	if !g.CanAccess([]byte("myotherkey1"), Read) || !g.CanAccess([]byte("mynumerickeysuffix7"), Read) || g.CanAccess([]byte("mynumerickeysuffixA"), Read) {
		t.Fatal("pattern keys")
	}
	if !g.CanAccess([]byte("clients/temperature-sensor/x"), Read) || g.CanAccess([]byte("clients/humidity-sensor/x"), Read) {
		t.Fatal("client sandbox")
	}
	if g.CanAccess([]byte("myreadkey"), Write) {
		t.Fatal("Read granted Write")
	}
	org := p.Grant(Principal{ClientID: "other", Attributes: map[string]string{"city": "seattle", "organization": "contoso"}})
	if !org.CanConnect() || !org.CanPublish("/sensor/contoso") || !org.CanSubscribe("/commands/contoso") || org.CanSubscribe("/commands/#") {
		t.Fatal("attribute principal")
	}
	half := p.Grant(Principal{ClientID: "other", Attributes: map[string]string{"city": "seattle"}})
	if half.CanConnect() {
		t.Fatal("a partial attribute match is not a match")
	}
	if p.Grant(Principal{ClientID: "stranger"}).CanConnect() {
		t.Fatal("a principal no rule names may connect")
	}
}

func TestParseShortForms(t *testing.T) {
	for _, doc := range []string{
		"rules:\n  - principals: {usernames: [alice]}\n    brokerResources: [{method: Connect}]\n",
		"authorizationPolicies:\n  rules:\n    - principals: {usernames: [alice]}\n      brokerResources: [{method: connect}]\n",
	} {
		p, err := Parse([]byte(doc))
		if err != nil {
			t.Fatalf("%q: %v", doc, err)
		}
		if !p.Grant(Principal{ClientID: "x", Username: "alice"}).CanConnect() {
			t.Fatalf("%q: alice cannot connect", doc)
		}
		if p.Grant(Principal{ClientID: "alice"}).CanConnect() {
			t.Fatalf("%q: a client id matched a username rule", doc)
		}
	}
}

func TestParseErrors(t *testing.T) {
	for _, doc := range []string{
		"rules: [{brokerResources: [{method: Connect}]}]",
		"rules: [{principals: {clientIds: [a]}, brokerResources: [{method: Delete}]}]",
		"rules: [{principals: {clientIds: [a]}, brokerResources: [{method: Publish}]}]",
		"rules: [{principals: {clientIds: [a]}, brokerResources: [{method: Publish, topics: ['a/#/b']}]}]",
		"rules: [{principals: {clientIds: [a]}, brokerResources: [{method: Publish, topics: ['a/b+']}]}]",
		"rules: [{principals: {clientIds: [a]}, brokerResources: [{method: Publish, topics: ['{principal.nope}']}]}]",
		"rules: [{principals: {clientIds: [a]}, stateStoreResources: [{method: Read, keyType: Regex, keys: [x]}]}]",
		"rules: [{principals: {clientIds: [a]}, stateStoreResources: [{method: Modify, keys: [x]}]}]",
		"rules: [{principals: {clientIds: [a]}, stateStoreResources: [{method: Read, keyType: Binary, keys: ['***']}]}]",
		"rules: [{principals: {clientIds: [a]}, stateStoreResources: [{method: Read}]}]",
		"rules: [{principals: {attributes: [{}]}, brokerResources: [{method: Connect}]}]",
		"rules: [{principals: {clientIds: [a]}, brokerResourcez: []}]",
		"kind: BrokerAuthentication\n",
		"rules: {",
	} {
		if _, err := Parse([]byte(doc)); err == nil {
			t.Errorf("accepted %q", doc)
		}
	}
}

func TestSubstitutedValuesCannotWidenGrants(t *testing.T) {
	p, err := Parse([]byte(`rules:
  - principals: {clientIds: ["*"]}
    brokerResources:
      - {method: Connect}
      - {method: Publish, topics: ["clients/{principal.clientId}/out"]}
    stateStoreResources:
      - {method: ReadWrite, keys: ["clients/{principal.clientId}/*"]}
`))
	if err != nil {
		t.Fatal(err)
	}
	g := p.Grant(Principal{ClientID: "*"})
	if g.CanAccess([]byte("clients/victim/secret"), Write) {
		t.Fatal(`client id "*" widened its key sandbox`)
	}
	if !g.CanAccess([]byte("clients/*/mine"), Write) {
		t.Fatal(`client id "*" lost its own sandbox`)
	}
	h := p.Grant(Principal{ClientID: "+"})
	if h.CanPublish("clients/victim/out") || h.CanPublish("clients/+/out") {
		t.Fatal(`client id "+" widened its topics`)
	}
	// A '/' in a value would reach into another principal's subtree.
	v := p.Grant(Principal{ClientID: "victim/x"})
	if v.CanPublish("clients/victim/x/out") || v.CanAccess([]byte("clients/victim/x/k"), Write) {
		t.Fatal(`client id "victim/x" reached into victim's topics or keys`)
	}
}

func TestNilGrantAllowsEverything(t *testing.T) {
	var g *Grant
	if !g.CanConnect() || !g.CanPublish("x") || !g.CanSubscribe("#") || !g.CanAccess([]byte("k"), Write) {
		t.Fatal("nil grant must allow everything")
	}
}

func TestSharedSubscriptionJudgedByFilter(t *testing.T) {
	p, _ := Parse([]byte("rules: [{principals: {clientIds: [a]}, brokerResources: [{method: Subscribe, topics: ['jobs/#']}]}]"))
	g := p.Grant(Principal{ClientID: "a"})
	if !g.CanSubscribe("$share/workers/jobs/x") || g.CanSubscribe("$share/workers/other") {
		t.Fatal("shared subscription")
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(aioPolicy))
	f.Add([]byte("rules: [{principals: {clientIds: [a]}, brokerResources: [{method: Connect}]}]"))
	f.Add([]byte("rules: [{principals: {usernames: ['{']}}]"))
	f.Fuzz(func(t *testing.T, b []byte) {
		p, err := Parse(b)
		if err != nil {
			return
		}
		g := p.Grant(Principal{ClientID: "c", Username: "u", Attributes: map[string]string{"a": "b"}})
		g.CanConnect()
		g.CanPublish("a/b")
		g.CanSubscribe("a/#")
		g.CanAccess([]byte("k"), Read)
	})
}

// FuzzGlob checks the matcher with substitution: an escaped value is always
// matched literally, and matching never panics or hangs.
func FuzzGlob(f *testing.F) {
	f.Add("clients/{principal.clientId}/*", "dev*1", "clients/dev*1/x")
	f.Add("[a-", "x", "[a-")
	f.Add(`\`, "", `\`)
	f.Fuzz(func(t *testing.T, pattern, clientID, key string) {
		if checkVariables(pattern) != nil {
			return
		}
		p := Principal{ClientID: clientID}
		s, ok := substitute(pattern, &p, globValue)
		if !ok {
			return
		}
		glob.Match([]byte(s), []byte(key))
		if !glob.Match([]byte(glob.Escape(clientID)), []byte(clientID)) {
			t.Fatalf("escaped %q does not match itself", clientID)
		}
	})
}

// The benchmark's 50-rule policy stays valid and grants the benchmark's
// clients what they use.
func TestBenchPolicyFile(t *testing.T) {
	p, err := Load("../../docs/bench-policy-50.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if p.Rules() != 50 {
		t.Fatalf("%d rules", p.Rules())
	}
	g := p.Grant(Principal{ClientID: "bench-set-0a1b2c3d-7"})
	if !g.CanConnect() || !g.CanAccess([]byte("bench/key/42"), Write) || !g.CanAccess([]byte("bench/lease/bench-set-0a1b2c3d-7"), Write) {
		t.Fatal("the benchmark clients are not granted their keys")
	}
	if g.CanAccess([]byte("other"), Read) {
		t.Fatal("granted a key no rule names")
	}
}
