package main

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/mqkv/mqkv/internal/auth"
)

func passwdCmd() *cobra.Command {
	var del bool
	cmd := &cobra.Command{
		Use:   "passwd FILE USERNAME",
		Short: "Add, change or delete a user in a password file",
		Long: `Adds USERNAME to the password file FILE (creating it), or changes its
password, storing a bcrypt hash. The password is read from standard input:
typed at the prompt (not shown, asked twice), or piped (the first line).
Then run mqkv serve --password-file FILE; SIGHUP reloads it.`,
		Example: `  mqkv passwd /etc/mqkv/passwd alice
  printf '%s\n' "$PASSWORD" | mqkv passwd /etc/mqkv/passwd sensor-17
  mqkv passwd --delete /etc/mqkv/passwd alice`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			file, user := args[0], args[1]
			if del {
				return auth.DeletePassword(file, user)
			}
			if fd := int(os.Stdin.Fd()); term.IsTerminal(fd) {
				pw, err := askTwice(fd, user)
				if err != nil {
					return err
				}
				return auth.SetPassword(file, user, pw)
			}
			line, err := bufio.NewReader(os.Stdin).ReadString('\n')
			if err != nil && line == "" {
				return errors.New("passwd: no password on standard input")
			}
			return auth.SetPassword(file, user, []byte(strings.TrimRight(line, "\r\n")))
		},
	}
	cmd.Flags().BoolVar(&del, "delete", false, "remove the user instead")
	return cmd
}

// askTwice reads a password at the terminal without echo, twice.
func askTwice(fd int, user string) ([]byte, error) {
	fmt.Fprintf(os.Stderr, "Password for %s: ", user)
	first, err := term.ReadPassword(fd)
	fmt.Fprintln(os.Stderr)
	if err != nil {
		return nil, err
	}
	fmt.Fprint(os.Stderr, "Again: ")
	again, err := term.ReadPassword(fd)
	fmt.Fprintln(os.Stderr)
	if err != nil {
		return nil, err
	}
	if string(first) != string(again) {
		return nil, errors.New("passwd: the two passwords differ; nothing changed")
	}
	return first, nil
}
