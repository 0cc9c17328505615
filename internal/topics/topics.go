// Package topics holds the MQTT topic names of the state store protocol
// (spec section 1), shared by the server, the Go client and the tools. It
// imports nothing, so the client does not pull the server in.
package topics

const (
	// Request is the topic state store requests are published to.
	Request = "statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8/command/invoke"
	// NotifyPrefix starts every notification topic:
	// NotifyPrefix/<client id>/command/notify/<key>, ids and keys in hex.
	NotifyPrefix = "clients/statestore/v1/FA9AE35F-2F64-47CD-9BFF-08E2B32A0FE8"
)
