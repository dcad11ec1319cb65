"""Tests of zeroshard/checkpoint/."""
