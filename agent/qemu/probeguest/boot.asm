# The accelerator probe guest: a boot sector that makes the mode changes a
# boot loader makes (real mode -> 32-bit protected mode with a TSS -> iret
# into virtual-8086 mode, as syslinux does) and only then prints the marker
# on COM1, from v86 mode. A nested KVM that cannot emulate those transitions
# stops with "KVM internal error" before the marker appears.
#
# boot.bin is this file assembled (binutils):
#   as --32 -o boot.o boot.asm
#   ld -m elf_i386 -Ttext 0x7c00 -e 0x7c00 --oformat binary -o boot.bin boot.o
	.code16
	.org 0
start:
	cli
	cld
	xorw %ax, %ax
	movw %ax, %ds
	movw %ax, %es
	movw %ax, %ss
	movw $0x7c00, %sp
	# TSS at 0x1000: zeroed, ss0:esp0, I/O bitmap right after it (all
	# ports allowed) ending in 0xff. v86 I/O always consults the bitmap.
	movw $0x1000, %di
	movw $0x100, %cx
	xorb %al, %al
	rep stosb
	movl $0x7000, 0x1004
	movw $0x10, 0x1008
	movw $0x68, 0x1066
	movb $0xff, 0x10e8
	lgdt gdtr
	movl %cr0, %eax
	orl $1, %eax
	movl %eax, %cr0
	ljmp $0x08, $pm32
	.code32
pm32:
	movw $0x10, %ax
	movw %ax, %ds
	movw %ax, %es
	movw %ax, %ss
	movl $0x7000, %esp
	movw $0x18, %ax
	ltr %ax
	# iret frame for v86 (popped eip, cs, eflags, esp, ss, es, ds, fs, gs)
	pushl $0
	pushl $0
	pushl $0
	pushl $0
	pushl $0
	pushl $0x6000
	pushl $0x20002          # VM=1, reserved bit 1
	pushl $0
	pushl $v86
	iretl
	.code16
v86:
	movw $0x3f8, %dx
	movw $msg, %si
1:	lodsb
	testb %al, %al
	jz 2f
	outb %al, %dx
	jmp 1b
2:	jmp 2b

	.p2align 3
gdt:
	.quad 0
	.quad 0x00cf9a000000ffff   # 0x08 code32 flat
	.quad 0x00cf92000000ffff   # 0x10 data32 flat
	.quad 0x00008910000000e8   # 0x18 32-bit TSS, base 0x1000, limit 0xe8
gdtr:
	.word gdtr - gdt - 1
	.long gdt
msg:
	.asciz "EITRI-PROBE-OK\r\n"
	.org 510
	.word 0xaa55
