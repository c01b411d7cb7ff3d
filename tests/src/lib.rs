//! Helpers shared by the black-box tests: start the real `sparkd` binary, talk to it over loopback.
