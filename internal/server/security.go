package server

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"github.com/mqkv/mqkv/internal/auth"
	"github.com/mqkv/mqkv/internal/broker"
	"github.com/mqkv/mqkv/internal/policy"
)

// listenersOf builds the listener list, loading TLS material so that a
// missing or broken file stops the start with a clear message.
func listenersOf(cfg Config) ([]broker.Listener, error) {
	var out []broker.Listener
	if cfg.Listen != "" {
		out = append(out, broker.Listener{Name: "tcp", Addr: cfg.Listen})
	}
	var tlsCfg *tls.Config
	if cfg.TLSListen != "" || cfg.WSTLS {
		if cfg.TLSCert == "" || cfg.TLSKey == "" {
			return nil, errors.New("tls: a TLS listener needs --tls-cert and --tls-key")
		}
		cert, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
		if err != nil {
			return nil, fmt.Errorf("tls: cannot load certificate %s with key %s: %w", cfg.TLSCert, cfg.TLSKey, err)
		}
		tlsCfg = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
		if cfg.TLSClientCA != "" {
			pem, err := os.ReadFile(cfg.TLSClientCA)
			if err != nil {
				return nil, fmt.Errorf("tls: client CA: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("tls: client CA %s holds no PEM certificate", cfg.TLSClientCA)
			}
			tlsCfg.ClientCAs = pool
			tlsCfg.ClientAuth = tls.RequireAndVerifyClientCert
			if cfg.TLSClientCertOptional {
				tlsCfg.ClientAuth = tls.VerifyClientCertIfGiven
			}
		}
	} else if (cfg.TLSCert != "" || cfg.TLSKey != "" || cfg.TLSClientCA != "") && !cfg.HTTPTLS {
		return nil, errors.New("tls: certificate files given but no TLS listener (--tls-listen or --ws-tls)")
	}
	if cfg.TLSListen != "" {
		out = append(out, broker.Listener{Name: "tls", Addr: cfg.TLSListen, TLS: tlsCfg})
	}
	if cfg.WSListen != "" {
		l := broker.Listener{Name: "ws", Addr: cfg.WSListen, WebSocket: true}
		if cfg.WSTLS {
			l.Name, l.TLS = "wss", tlsCfg
		}
		out = append(out, l)
	} else if cfg.WSTLS {
		return nil, errors.New("--ws-tls needs --ws-listen")
	}
	if len(out) == 0 && cfg.Attach == nil {
		return nil, errors.New("no listener: give at least one of --listen, --tls-listen, --ws-listen")
	}
	return out, nil
}

// securityOf loads authentication and authorization files.
func securityOf(cfg Config) (broker.Security, error) {
	var sec broker.Security
	var err error
	if cfg.PasswordFile != "" {
		if sec.Passwords, err = auth.LoadPasswords(cfg.PasswordFile); err != nil {
			return sec, err
		}
	}
	if cfg.CertAttributesFile != "" {
		if sec.CertAttributes, err = auth.LoadCertAttributes(cfg.CertAttributesFile); err != nil {
			return sec, err
		}
	}
	authConfigured := cfg.PasswordFile != "" || cfg.TLSClientCA != ""
	sec.AllowAnonymous = cfg.AllowAnonymous || !authConfigured
	sec.Certificates = cfg.TLSClientCA != ""
	if !authConfigured && cfg.Attach == nil {
		cfg.Logger.Warn("authentication is off: no --password-file or --tls-client-ca, every client is admitted anonymously")
	}
	if sec.Policy, err = loadPolicy(cfg); err != nil {
		return sec, err
	}
	return sec, nil
}

// loadPolicy reads the policy file. No policy configured allows
// everything, with a warning. A configured file that is missing or broken
// is an error: a typo in a path, or a file replaced while an editor saves
// it, must not turn authorization off.
func loadPolicy(cfg Config) (*policy.Policy, error) {
	if cfg.PolicyFile == "" {
		if cfg.Attach != nil {
			cfg.Logger.Warn("no authorization policy (--policy): every client of the broker may read and write every key")
		} else {
			cfg.Logger.Warn("no authorization policy (--policy): every admitted client may do everything")
		}
		return nil, nil
	}
	p, err := policy.Load(cfg.PolicyFile)
	if err != nil {
		return nil, err
	}
	cfg.Logger.Info("authorization policy loaded", "policy", cfg.PolicyFile, "rules", p.Rules())
	return p, nil
}

// Reload reads the policy and password files again (SIGHUP). A file that
// fails to load leaves the running configuration as it was.
func (s *Server) Reload() error {
	var errs []error
	if s.cfg.PasswordFile != "" {
		if p, err := auth.LoadPasswords(s.cfg.PasswordFile); err != nil {
			errs = append(errs, err)
		} else {
			s.broker.SetPasswords(p)
			s.log.Info("password file reloaded", "users", p.Users())
		}
	}
	if p, err := loadPolicy(s.cfg); err != nil {
		errs = append(errs, err)
	} else {
		s.broker.SetPolicy(p)
	}
	return errors.Join(errs...)
}
