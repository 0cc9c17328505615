package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/mqkv/mqkv/internal/auth"
)

// passwd writes password file entries, like mosquitto_passwd.
func passwd(args []string) error {
	fs := flag.NewFlagSet("passwd", flag.ContinueOnError)
	del := fs.Bool("delete", false, "remove the user instead")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `Usage: mqkv passwd [--delete] FILE USERNAME

Adds USERNAME to the password file FILE (creating it), or changes its
password, storing a bcrypt hash. The password is read from standard input:
typed at the prompt, or piped (the first line).

Examples:
  mqkv passwd /etc/mqkv/passwd alice
  printf '%%s\n' "$PASSWORD" | mqkv passwd /etc/mqkv/passwd sensor-17
  mqkv passwd --delete /etc/mqkv/passwd alice

Then: mqkv serve --password-file /etc/mqkv/passwd (SIGHUP reloads it).

Flags:
`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return nil
		}
		return err
	}
	if fs.NArg() != 2 {
		fs.Usage()
		return errors.New("passwd: want FILE USERNAME")
	}
	file, user := fs.Arg(0), fs.Arg(1)
	if *del {
		return auth.DeletePassword(file, user)
	}
	if fi, err := os.Stdin.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		fmt.Fprintf(os.Stderr, "Password for %s (shown as typed; pipe it in to keep it off the screen): ", user)
	}
	line, err := bufio.NewReader(os.Stdin).ReadString('\n')
	if err != nil && line == "" {
		return errors.New("passwd: no password on standard input")
	}
	pw := strings.TrimRight(line, "\r\n")
	return auth.SetPassword(file, user, []byte(pw))
}
