#!/usr/bin/env perl
# An AnyEvent echo server and client (the EV backend: libev's epoll loop) for
# scripts/preload-apps.sh.
#
#   perl preload-anyevent.pl server PORT CONNS        echo CONNS connections, then exit
#   perl preload-anyevent.pl client PORT CONNS BYTES  CONNS concurrent connections, BYTES each way
#
# tcp_server/tcp_connect (nonblocking connect, a write watcher for its end), AnyEvent::Handle
# reading and writing from I/O watchers; each client queues BYTES of random data in 100 kB
# pieces and a shutdown, and reads the echo to the end of stream; its SHA-256 must be the
# one of what was sent. Exit 1 on a mismatch, an error or after 60 s.
use strict;
use warnings;
use EV;
use AnyEvent;
use AnyEvent::Socket;
use AnyEvent::Handle;
use Digest::SHA qw(sha256_hex);

my ($mode, $port, $n, $bytes) = @ARGV;
my $cv = AE::cv;
my $t = AE::timer 60, 0, sub { print "preload-anyevent: timeout\n"; exit 1 };
AnyEvent::detect() eq "AnyEvent::Impl::EV"
    or die "AnyEvent model " . AnyEvent::detect() . ", EV expected";
if ($mode eq 'server') {
    my ($left, $total) = ($n, 0);
    my %h;
    tcp_server '127.0.0.1', $port, sub {
        my ($fh) = @_;
        my $hd;
        $hd = AnyEvent::Handle->new(
            fh => $fh,
            on_read => sub { my $d = delete $_[0]{rbuf}; $total += length $d; $_[0]->push_write($d) },
            on_eof => sub {
                $hd->push_shutdown;
                $hd->on_drain(sub { delete $h{$hd}; $hd->destroy; $cv->send if --$left == 0 });
            },
            on_error => sub { die "server: $_[2]" });
        $h{$hd} = $hd;
    };
    $cv->recv;
    print "anyevent server: $n connections, $total bytes echoed\n";
} else {
    my $data = '';
    open my $u, '<', '/dev/urandom' or die "urandom: $!";
    read $u, $data, $bytes;
    my $want = sha256_hex($data);
    my $left = $n;
    my @keep;
    for my $i (1 .. $n) {
        tcp_connect '127.0.0.1', $port, sub {
            my ($fh) = @_ or die "connect: $!";
            my $sha = Digest::SHA->new(256);
            my $got = 0;
            my $hd;
            $hd = AnyEvent::Handle->new(
                fh => $fh,
                on_read => sub { my $d = delete $_[0]{rbuf}; $sha->add($d); $got += length $d },
                on_eof => sub {
                    die "echo $i differs ($got bytes)" unless $got == $bytes && $sha->hexdigest eq $want;
                    $hd->destroy;
                    $cv->send if --$left == 0;
                },
                on_error => sub { die "client: $_[2]" });
            push @keep, $hd;
            for (my $k = 0; $k < $bytes; $k += 100000) {
                $hd->push_write(substr($data, $k, 100000));
            }
            $hd->push_shutdown;
        };
    }
    $cv->recv;
    print "anyevent client: $n connections, $bytes bytes each, echoes right\n";
}
